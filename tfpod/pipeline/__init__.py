"""Pipeline parallelism: a model's blocks in stages on disjoint sub-meshes, fed microbatches.

    --mesh=stage:2,data:2,model:2 --gin_param=train.microbatches=4
        --gin_param="sharding.pipeline_schedule='1f1b'"

The `stage` mesh axis splits the devices into stage sub-meshes (each with the other
axes; tfpod.partitioning.stages), the task cuts its model into a StagedModel
(tfpod.task: embeddings first, equal runs of blocks, output layer and loss last), each
weight and its optimizer state are created on their stage's mesh, and each step's
executor (`step.Pipeline.loss_and_gradients`) runs a schedule (`schedules`: GPipe or
1F1B) over `train.microbatches` microbatches and accumulates their gradients; the step
ends in the one update every model's does (tfpod.trainer.make_train_loop). The
presets, sequence parallelism and recomputation apply inside each stage. Without a
`stage` axis, train.microbatches > 1 is gradient accumulation on the one mesh, for every
model (tfpod.trainer.make_train_loop).

  schedules  the per-stage action orders, their timeline, bubble and peak activations
  step       Pipeline: the step's executor and the eval forward over the stages
"""

from __future__ import annotations

from tfpod import UserError
from tfpod.pipeline import schedules
from tfpod.pipeline.step import Pipeline, variable_stages
from tfpod.task import StagedModel


def check_pipelines(task, able: str = "") -> None:
    """One UserError line when `task` declares no stages (Task.pipelines); `able` names the
    models that do (the caller's registry: this package sits below the models)."""
    if not task.pipelines:
        raise UserError(f"model {task.name!r} does not run in pipeline stages (a `stage` mesh axis): pipelines "
                        f"are for {able or 'models whose Task declares stages'}; drop the stage axis "
                        f"(train.microbatches alone accumulates gradients for every model)")


def staged_model(task, model) -> StagedModel:
    """The task's StagedModel of `model`; a task that does not pipeline is one UserError."""
    check_pipelines(task)
    return task.staged(model)


__all__ = ["Pipeline", "StagedModel", "check_pipelines", "schedules", "staged_model", "variable_stages"]
