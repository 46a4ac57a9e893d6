"""The training state: the one description of what a run's checkpoint holds and a resume restores.

    step       the global step: the optimizer's iteration counter (a DVariable on the mesh;
               a checkpoint is named ckpt-<step> and saved and read on the step's mesh)
    model      the weights (all of them, or `saved`: a LoRA run's adapters, whose frozen base
               is read first from its own checkpoint, `base`)
    optimizer  its state: slots and the learning-rate schedule's step (the same counter)
    through_first_stage
               pipeline stages' variables are written and read through the first stage's
               mesh (tfpod.partitioning.stages.save_through): a restore reads them into
               holders there, listed here, and `after_restore` copies them back

Beside the checkpoint in the run folder, each written with it by its owner and read on
resume: this host's input position (tfpod.input_position, through the feed: written
before the checkpoint, so a checkpoint always has one) and the planner's choice
(`plan.json`, tfpod.plan: a resumed `--mesh=auto` run keeps its layout). The dropout
generator has no state to save: every mask is a function of the seed, the layer, the
step and the microbatch (tfpod.partitioning.dropout), so restoring the step restores it.

CheckpointManager (saving, restoring, the finite check) and its background writer read
the trackables from here; nothing else decides what the state is.
"""

from __future__ import annotations

import dataclasses

from tfpod.partitioning import stages


@dataclasses.dataclass
class TrainState:
    """A run's step, model and optimizer (see the module docstring).

    Attributes:
      step: the global step variable.
      model: the model (its weights).
      optimizer: the optimizer (None: a state of weights only, e.g. a converter's or a
        bare module's).
      saved: what checkpoints hold of the model (None: the model; tfpod.lora.saved_weights:
        a LoRA run's trained weights alone).
      base: the checkpoint a restore first reads the rest of the model's weights from (a LoRA
        run's base, tfpod.lora.check_base), or None.
      through_first_stage: (variable, holder) pairs the latest restore read through the
        first stage (filled during a restore, drained by `after_restore`).
    """

    step: object
    model: object
    optimizer: object = None
    saved: object = None
    base: str | None = None
    through_first_stage: list = dataclasses.field(default_factory=list)

    def trackables(self) -> dict:
        """{checkpoint key: object}: what tf.train.Checkpoint saves ("model", "optimizer")."""
        model = self.model if self.saved is None else self.saved
        return {"model": model} if self.optimizer is None else {"model": model, "optimizer": self.optimizer}

    def save_through(self, variables, mesh, target=None, copy=None) -> None:
        """Saves and restores `variables` of other pipeline stages (or sub-meshes) through `mesh`
        (the first stage's); `target(variable)` and `copy`: stages.save_through's."""
        for v in variables:
            stages.save_through(v, mesh, self.through_first_stage, target and target(v), copy)

    def after_restore(self) -> None:
        """Copies what a restore read into the first stage's holders to their stages' variables."""
        stages.apply_restored(self.through_first_stage)
