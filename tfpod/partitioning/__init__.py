"""Partitioning, owned in one place: logical axes, rules tables as data, validation, layouts.

Models name the dimensions of their variables with *logical axes* (`batch`, `length`,
`height`, `embed`, `heads`, `kv`, `mlp`, `vocab`, `expert`). Variable-path rules (regex over the
variable name, e.g. `gpt/block_\\d+/self_attention/query/kernel`) give logical axes to
variables of layers we do not write (tf-models-official). One *rules table* maps each
logical axis to a mesh axis (or to nothing: replicated). A *preset* is one object
(tfpod.partitioning.presets.Preset): a named rules table, the axes its optimizer update
is sharded over and its weights gathered over, whether `--mesh=auto` tries it, and its
checks against tasks, pipeline stages and the Keras front end. The presets: data,
tensor (Megatron-LM), 2d, weight_update (ZeRO-style), spatial (image rows); see
tfpod.partitioning.presets.

Two switches combine with any preset: `sequence_parallel` maps the residual stream's
`sequence` axis to `model` (Megatron sequence parallelism: layer norms and dropout
between blocks run on sequence shards), and `update_axis` names a mesh axis over which
the optimizer state and update are sharded.

A rules table names mesh axes, not sizes: on a mesh without a `model` axis the
`tensor` preset's model-parallel dimensions are simply replicated, so one table serves
every mesh. Within one tensor a mesh axis shards at most one dimension (the first).

Everything is validated before a variable is allocated: a rank mismatch, a dimension
not divisible by its mesh axis, a variable matched by two rules, a variable matched by
none, and a rule that matches nothing each raise one UserError naming the variable, its
shape and the rule.

The modules, each usable on its own (this package re-exports their public names):

  presets      the Preset objects and their registry (PRESETS, get_preset, register)
  rules        logical axes, AxisRule, rules_table, resolve (validation),
               check_mesh_axes, layout_for
  sharding_config
               ShardingConfig (gin `sharding.*`): the run's preset resolved once
               (preset_for), its table with the overrides, the update axis
  report       the layout report (layouts.txt)
  build        a tf_keras model materialized as DVariables laid out by the rules;
               update_layout (weight-update sharding); gather_when_used (`2d`)
  step_context the traced step's context (StepContext: mesh, table, microbatch, stage,
               attention) and shard / split / replicate of activations inside it
  spatial      convolutions and pooling on image rows split over a mesh axis (halo exchange)
  stages       the `stage` axis: pipeline stages' sub-meshes, copies between them
  submesh      the devices at one position of an axis as a mesh, copies to and from it by pieces
  context      the `context` axis: sequences in balanced chunks (context parallelism)
  dropout      dropout masks a resumed run replays, the same on every mesh
  placement    Placement: the mesh, the table, the update and gather axes, and which
               rows of the global batch each host feeds (host_rows, to_global, to_host)
"""


from tfpod.partitioning.step_context import (activation_sharding, active_context, current_context, replicate, shard,
                                             split, tracing)
from tfpod.partitioning import context, spatial, stages, submesh
from tfpod.partitioning.build import (build_sharded, compute_layout, gather_when_used, gathered_weights, rows_split,
                                      lazy_model, update_layout, var_name, variable_specs)
from tfpod.partitioning.dropout import counter_uniform, microbatch, replayable_dropout
from tfpod.partitioning.placement import (Placement, batch_mesh_axis, check_microbatches, host_rows, local_shards,
                                         place, split_microbatches)
from tfpod.partitioning.report import bytes_by_device, bytes_per_device, layout_report
from tfpod.partitioning.presets import PRESETS, Preset, get_preset
from tfpod.partitioning.rules import (CONTEXT_AXIS, LOGICAL_AXES, AxisRule, VarSpec, check_mesh_axes, layout_for,
                                      resolve, rules_table)
from tfpod.partitioning.sharding_config import ShardingConfig

__all__ = [
    "activation_sharding",
    "active_context",
    "current_context",
    "tracing",
    "replicate",
    "shard",
    "split",
    "build_sharded",
    "compute_layout",
    "gather_when_used",
    "gathered_weights",
    "rows_split",
    "update_layout",
    "variable_specs",
    "var_name",
    "lazy_model",
    "counter_uniform",
    "microbatch",
    "replayable_dropout",
    "Placement",
    "batch_mesh_axis",
    "check_microbatches",
    "host_rows",
    "local_shards",
    "place",
    "split_microbatches",
    "bytes_by_device",
    "bytes_per_device",
    "layout_report",
    "CONTEXT_AXIS",
    "LOGICAL_AXES",
    "PRESETS",
    "Preset",
    "get_preset",
    "AxisRule",
    "ShardingConfig",
    "VarSpec",
    "check_mesh_axes",
    "layout_for",
    "resolve",
    "rules_table",
]
