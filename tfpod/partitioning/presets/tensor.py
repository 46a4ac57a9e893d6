"""tensor: Megatron-LM tensor parallelism, with the batch over `data`.

Heads and the MLP's hidden units over `model` (column-parallel into a block, row-parallel
out of it), a vocab-parallel embedding and output layer, MoE experts over `expert`.
"""

from tfpod.partitioning.presets.base import MEGATRON, Preset

PRESET = Preset("tensor", {"batch": "data", **MEGATRON},
                "Megatron-LM: heads, MLP hidden units and vocab over `model`, experts over `expert`")
