"""`tfpod.keras.Checkpoint`: tfpod's checkpoint layout for Keras `fit`, with resume."""

from __future__ import annotations

import logging

import tensorflow as tf
import tf_keras

from tfpod import UserError, checkpoint as checkpointlib, compat
from tfpod.keras import support
from tfpod.train_state import TrainState

log = logging.getLogger("tfpod")

class _Resume:
    """What Model.fit asks a model's training state for: the (epoch, step) to start at."""

    def __init__(self, step: int):
        self.step = step

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        del mode
        if not steps_per_epoch:
            log.warning("resumed at step %d but the epoch length is unknown: fit starts at epoch %d",
                        self.step, initial_epoch)
            return initial_epoch, 0
        epoch, step = divmod(self.step, int(steps_per_epoch))
        if epoch < initial_epoch:
            return initial_epoch, 0
        return epoch, step


class Checkpoint(tf_keras.callbacks.Callback):
    """Saves the sharded model and optimizer in tfpod's checkpoint layout; resumes fit from them.

    Writes `model_dir/checkpoints/ckpt-<step>` (step = the optimizer's step counter)
    through tfpod.checkpoint.CheckpointManager: the newest `keep` are kept, and a
    checkpoint with missing files (a save cut short) is never resumed from. At the
    start of fit the newest complete checkpoint is restored and fit continues at its
    step: epoch = step // steps_per_epoch, and the rest of that epoch (its batches
    start again from the beginning of the data, as with Keras's BackupAndRestore,
    unless the checkpoint was at an epoch end). `main.py --mode=eval` and other
    tfpod tools read the same layout.

    Args:
      model_dir: output folder.
      every_n_epochs: save at the end of every n-th epoch (0: not by epochs).
      every_n_steps: also save every n optimizer steps (None: not by steps).
      keep: how many checkpoints to keep.
      restore: restore the newest checkpoint at the start of fit.
    """

    def __init__(self, model_dir: str, every_n_epochs: int = 1, every_n_steps: int | None = None, keep: int = 3,
                 restore: bool = True):
        super().__init__()
        if every_n_epochs < 0 or (every_n_steps is not None and every_n_steps < 1):
            raise UserError(
                f"tfpod.keras.Checkpoint: every_n_epochs={every_n_epochs} must be >= 0 and every_n_steps="
                f"{every_n_steps} >= 1 (or None)"
            )
        if keep < 1:
            raise UserError(f"tfpod.keras.Checkpoint: keep={keep} must be at least 1")
        self.model_dir, self.every_n_epochs, self.every_n_steps = model_dir, every_n_epochs, every_n_steps
        self.keep, self.restore = keep, restore
        self.manager: checkpointlib.CheckpointManager | None = None
        self.restored_step: int | None = None
        self._saved_step = -1
        self._previous_state = None

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def on_train_begin(self, logs=None):
        model = self.model
        support.refuse_keras3(model, "tfpod.keras.Checkpoint")
        optimizer = model.optimizer
        if optimizer is None:
            raise UserError("tfpod.keras.Checkpoint: compile the model before fit")
        _build_optimizer_state(optimizer, model)
        if self.manager is None:
            self.manager = checkpointlib.CheckpointManager(
                self.model_dir, TrainState(optimizer.iterations, model, optimizer), keep=self.keep)
        self.restored_step = self.manager.restore_latest() if self.restore else None
        self._saved_step = self.restored_step if self.restored_step is not None else -1
        self._previous_state = compat.training_state(model)
        if self.restored_step:
            compat.set_training_state(model, _Resume(self.restored_step))

    def _save(self):
        step = self._step()
        if step != self._saved_step:
            self.manager.save()
            self._saved_step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_steps:
            step = self._step()
            if step // self.every_n_steps > max(self._saved_step, 0) // self.every_n_steps:
                self._save()

    def on_epoch_end(self, epoch, logs=None):
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self._save()

    def on_train_end(self, logs=None):
        self._save()
        compat.set_training_state(self.model, self._previous_state)


def _build_optimizer_state(optimizer, model) -> None:
    """Creates the optimizer's slots now, so a checkpoint restores into them (not lazily later)."""
    if isinstance(optimizer, tf_keras.optimizers.Optimizer) and not compat.optimizer_built(optimizer):
        with tf.init_scope():
            optimizer.build(model.trainable_variables)
