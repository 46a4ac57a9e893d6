"""Presets: the named ways to shard a model, one object each (`Preset`, in base.py).

    data           every weight replicated, the batch split over `data`
    tensor         Megatron-LM: heads and mlp hidden over `model` (column-parallel into
                   a block, row-parallel out of it), vocab-parallel embedding and
                   output layer; MoE experts over `expert`
    2d             `tensor`, and every weight's `embed` dimension also over `data`
                   (weights and optimizer state divided by the whole mesh; gathered
                   where a layer uses them)
    weight_update  `tensor` for compute, and the optimizer state and update sharded
                   over `data` (MLPerf TPU-pod weight-update sharding, ZeRO-style)
    spatial        image models: every weight replicated, the batch over `data` and each
                   image's rows (`height`) over `model` (MLPerf's spatial partitioning)

To add a preset: a module here defining `PRESET = Preset(...)` (a subclass where it
needs its own checks), and its module in `_BUILTIN` below. Code outside tfpod can
`register` one at import time.
"""

from __future__ import annotations

from tfpod import UserError
from tfpod.partitioning.presets import data, spatial, tensor, two_d, weight_update
from tfpod.partitioning.presets.base import MEGATRON, Preset

PRESETS: dict[str, Preset] = {}


def register(preset: Preset) -> Preset:
    """Adds `preset` under its name (`sharding.preset='<name>'`); a name taken is an error."""
    if not isinstance(preset, Preset):
        raise UserError(f"presets.register: a Preset, not {type(preset).__name__}")
    if preset.name in PRESETS:
        raise UserError(f"presets.register: a preset named {preset.name!r} exists; give yours another name")
    PRESETS[preset.name] = preset
    return preset


def get_preset(name: str) -> Preset:
    """The preset registered under `name`."""
    if name not in PRESETS:
        raise UserError(f"sharding.preset={name!r} is not a preset: use one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


_BUILTIN = (data, tensor, two_d, weight_update, spatial)  # --mesh=auto tries them in this order
for _module in _BUILTIN:
    register(_module.PRESET)

__all__ = ["MEGATRON", "PRESETS", "Preset", "get_preset", "register"]
