"""Pipeline parallelism: a model's blocks in stages on disjoint sub-meshes, fed microbatches.

    --mesh=stage:2,data:2,model:2 --gin_param=train.microbatches=4
        --gin_param="sharding.pipeline_schedule='1f1b'"

The `stage` mesh axis splits the devices into stage sub-meshes (each with the other
axes; tfpod.partitioning.stages), the task cuts its model into a StagedModel
(tfpod.task: embeddings first, equal runs of blocks, output layer and loss last), each
weight and its optimizer state are created on their stage's mesh, and the run's executor
(`executor.Pipeline`, a tfpod.executor.Executor) runs a schedule (`schedules`: GPipe or
1F1B) over `train.microbatches` microbatches and accumulates their gradients; the step
ends in the one update every model's does (tfpod.optimizers.Update.step, told where each
gradient lives by `homes.StageHomes`). The presets, sequence parallelism and
recomputation apply inside each stage. Without a `stage` axis, train.microbatches > 1 is
gradient accumulation on the one mesh, for every model (tfpod.executor.OneMesh).

  schedules  the per-stage action orders, their timeline, bubble and peak activations
  executor   Pipeline: the executor (packing, the step's loss and gradients, the host loop)
             and the eval forward over the stages
  homes      StageHomes: the one update's norm, clipping and apply, stage by stage
"""

from __future__ import annotations

from tfpod.pipeline import schedules
from tfpod.pipeline.homes import StageHomes
from tfpod.pipeline.executor import Pipeline, check_pipelines, staged_model, variable_stages
from tfpod.task import StagedModel

__all__ = ["Pipeline", "StageHomes", "StagedModel", "check_pipelines", "schedules", "staged_model", "variable_stages"]
