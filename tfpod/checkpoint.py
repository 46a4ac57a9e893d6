"""Checkpoints of the sharded training state.

One `tf.train.Checkpoint` holds the model and optimizer DVariables (the optimizer's
step counter is the global step). Every host takes part in the sharded write and read.
`CheckpointManager` resumes from the newest checkpoint in `model_dir`, saves every
`checkpoint_every` steps and at the end, and keeps the last `keep` checkpoints.
"""

from __future__ import annotations

import logging
import os

import tensorflow as tf

from tfpod import UserError

log = logging.getLogger("tfpod")


def complete_steps(directory: str) -> list[int]:
    """Steps of the checkpoints in `directory` whose index and every data shard are on disk, ascending.

    A host that dies while saving leaves a checkpoint that the manager's bookkeeping
    may already name but whose files are partial; such a one is skipped.
    """
    steps = []
    for index in tf.io.gfile.glob(os.path.join(directory, "ckpt-*.index")):
        prefix = index[: -len(".index")]
        data = tf.io.gfile.glob(prefix + ".data-*-of-*")
        if data and len(data) == int(data[0].rsplit("-of-", 1)[1]):
            steps.append(int(prefix.rsplit("-", 1)[1]))
    return sorted(steps)


class CheckpointManager:
    """Saves and restores {name: trackable} under model_dir/checkpoints."""

    def __init__(self, model_dir: str, step: tf.Variable, keep: int = 3, **trackables):
        if keep < 1:
            raise UserError(f"train.keep_checkpoints={keep} must be at least 1")
        self.directory = os.path.join(model_dir, "checkpoints")
        self._step = step
        self._ckpt = tf.train.Checkpoint(**trackables)
        self._manager = tf.train.CheckpointManager(self._ckpt, self.directory, max_to_keep=keep, step_counter=step)

    @property
    def latest(self) -> str | None:
        return self._manager.latest_checkpoint

    def complete_steps(self) -> list[int]:
        return complete_steps(self.directory)

    def restore(self, path: str) -> int:
        """Restores a given checkpoint (a prefix such as model_dir/checkpoints/ckpt-40)."""
        if not tf.io.gfile.exists(path + ".index"):
            raise UserError(f"--checkpoint={path}: no such checkpoint (expected {path}.index)")
        try:
            self._ckpt.restore(path).expect_partial()
        except (ValueError, tf.errors.OpError) as e:
            raise UserError(f"checkpoint {path} does not fit this model ({str(e).splitlines()[0]})") from None
        return int(self._step.numpy())

    def restore_latest(self) -> int | None:
        """Restores the newest complete checkpoint if there is one; returns its step or None."""
        steps = self.complete_steps()
        if not steps:
            if self._manager.latest_checkpoint:
                log.warning("checkpoint %s is incomplete and no complete one exists: starting from scratch",
                            self._manager.latest_checkpoint)
            return None
        path = os.path.join(self.directory, f"ckpt-{steps[-1]}")
        if self._manager.latest_checkpoint and self._manager.latest_checkpoint != path:
            log.warning("newest checkpoint %s is incomplete (a host stopped while saving): resuming from %s",
                        self._manager.latest_checkpoint, path)
        try:
            self._ckpt.restore(path).assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as e:
            raise UserError(
                f"checkpoint {path} does not fit this model ({str(e).splitlines()[0]}): "
                "use the gin config it was trained with, or a new --model_dir"
            ) from None
        step = int(self._step.numpy())
        log.info("resumed from %s at step %d", path, step)
        return step

    def save(self) -> str:
        step = int(self._step.numpy())
        path = self._manager.save(checkpoint_number=step)
        log.info("saved checkpoint %s", path)
        return path


class InputCheckpoint:
    """One host's input position (its tf.data iterator), saved beside each model checkpoint.

    A tf.data iterator cannot share a tf.train.Checkpoint with DVariables, so every host
    keeps its own small checkpoint in model_dir/checkpoints/input-host<h>/, numbered by
    the same step as the model checkpoint it belongs to. It is written before the model
    checkpoint, so the newest model checkpoint always has its input position.
    """

    def __init__(self, model_dir: str, host_id: int, iterator, keep: int = 3):
        self.directory = os.path.join(model_dir, "checkpoints", f"input-host{host_id}")
        self._ckpt = tf.train.Checkpoint(iterator=iterator)
        self._manager = tf.train.CheckpointManager(self._ckpt, self.directory, max_to_keep=keep)

    def save(self, step: int) -> None:
        self._manager.save(checkpoint_number=step)

    def restore(self, step: int) -> None:
        """Restores the position saved with the model checkpoint of `step`."""
        path = os.path.join(self.directory, f"ckpt-{step}")
        if not tf.io.gfile.exists(path + ".index"):
            raise UserError(
                f"checkpoint step {step} has no input position in {self.directory}: the input cannot resume "
                "exactly; restore that folder, or start a new --model_dir"
            )
        self._ckpt.restore(path).assert_existing_objects_matched()
        log.info("input resumed at step %d from %s", step, path)
