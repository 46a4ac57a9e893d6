"""2d: `tensor`, and every weight's `embed` dimension also over `data`.

Weights and optimizer state are divided by the whole mesh; each layer gathers its
weight's `data` shards where it uses it (tfpod.partitioning.build.gather_when_used), as
the weight-stationary 2D layouts of the Cohere pjit report and GSPMD.
"""

from tfpod.partitioning.presets.base import MEGATRON, Preset

PRESET = Preset("2d", {"batch": "data", **MEGATRON, "embed": "data"},
                "`tensor`, and every weight's `embed` dimension over `data`, gathered where used",
                gather_axis="data")
