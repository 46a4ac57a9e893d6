"""Pipeline parallelism: a model's blocks in stages on disjoint sub-meshes, fed microbatches.

    --mesh=stage:2,data:2,model:2 --gin_param=train.microbatches=4
        --gin_param="sharding.pipeline_schedule='1f1b'"

The `stage` mesh axis splits the devices into stage sub-meshes (each with the other
axes; tfpod.partitioning.stages), the task cuts its model into a StagedModel
(tfpod.task: embeddings first, equal runs of blocks, output layer and loss last), each
weight and its optimizer state are created on their stage's mesh, and one compiled step
runs a schedule (`schedules`: GPipe or 1F1B) over `train.microbatches` microbatches,
accumulates their gradients and applies one optimizer step (`step.Pipeline`). The
presets, sequence parallelism and recomputation apply inside each stage. Without a
`stage` axis, train.microbatches > 1 is gradient accumulation on the one mesh, for every
model (tfpod.trainer.make_train_loop).

  schedules  the per-stage action orders, their timeline, bubble and peak activations
  step       Pipeline: the compiled train step and the eval forward over the stages
"""

from __future__ import annotations

from tfpod import UserError
from tfpod.pipeline import schedules
from tfpod.partitioning.placement import check_microbatches, split_microbatches
from tfpod.pipeline.step import Pipeline, variable_stages
from tfpod.task import StagedModel


def staged_model(task, model) -> StagedModel:
    """The task's StagedModel of `model`; a task that does not pipeline is one UserError."""
    staged = task.staged(model)
    if staged is None:
        from tfpod.models import TASKS

        able = ", ".join(sorted(n for n, t in TASKS.items() if t.pipelines))
        raise UserError(f"model {task.name!r} does not run in pipeline stages (a `stage` mesh axis): pipelines "
                        f"are for {able}; drop the stage axis (train.microbatches alone accumulates gradients "
                        f"for every model)")
    return staged


__all__ = ["Pipeline", "StagedModel", "check_microbatches", "schedules", "split_microbatches", "staged_model",
           "variable_stages"]
