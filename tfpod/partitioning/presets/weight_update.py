"""weight_update: `tensor` for compute, the optimizer state and update sharded over `data`.

MLPerf's TPU-pod weight-update sharding (ZeRO-style): each `data` replica updates its
slice of every weight and the slices are all-gathered (tfpod.optimizers.Update).
"""

from tfpod.partitioning.presets.base import MEGATRON, Preset

PRESET = Preset("weight_update", {"batch": "data", **MEGATRON},
                "`tensor` for compute, the optimizer state and update sharded over `data`", update_axis="data")
