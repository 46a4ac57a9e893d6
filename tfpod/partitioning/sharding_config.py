"""`sharding.*`: what a run asks of partitioning, as one config (gin `sharding.<name>`).

The config names a preset (or leaves it to the task's default), overrides its rules, turns
on sequence parallelism, names the update axis and the pipeline schedule. Its preset is
resolved once, by `preset_for` (Placement.from_config), and the table and update axis are
read from that Preset.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from tfpod import UserError
from tfpod.partitioning.presets import Preset, get_preset
from tfpod.partitioning.rules import CONTEXT_AXIS, rules_table

PIPELINE_SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Attributes map 1:1 to gin `sharding.<name>`.

    Attributes:
      preset: a preset's name, see tfpod.partitioning.presets (None: the experiment's default).
      rules: {logical axis: mesh axis or None} overriding the preset's table.
      sequence_parallel: split the residual stream between blocks over `model` along
        the sequence (Megatron sequence parallelism).
      update_axis: mesh axis to shard the optimizer state and update over (None: the
        preset's; "" for none).
      pipeline_schedule: with a `stage` mesh axis, the order each stage runs its
        microbatches in: "gpipe" (all forwards, then all backwards) or "1f1b" (one
        forward, one backward: at most `stage` microbatches' activations alive).
      tables: how embedding tables (tfpod.embedding) lie over the mesh axis their rows map
        to: "rows" (each device holds 1/S of every table's rows) or "whole" (table-wise:
        each table whole on the devices of one position of that axis, balanced by bytes;
        tfpod.embedding.whole).
    """

    preset: str | None = None
    rules: Mapping[str, str | None] | None = None
    sequence_parallel: bool = False
    update_axis: str | None = None
    pipeline_schedule: str = "gpipe"
    tables: str = "rows"

    def __post_init__(self):
        if self.tables not in ("rows", "whole"):
            raise UserError(f"sharding.tables={self.tables!r}: use 'rows' (each device holds 1/S of every "
                            "table's rows) or 'whole' (table-wise: each table whole on the devices of one "
                            "position of its axis)")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise UserError(f"sharding.pipeline_schedule={self.pipeline_schedule!r}: use one of "
                            f"{', '.join(PIPELINE_SCHEDULES)}")

    def preset_for(self, default_preset: str) -> Preset:
        """The run's Preset: `preset`, or the task's `default_preset` when it is unset.

        Raises:
          UserError: no preset of that name is registered.
        """
        return get_preset(self.preset or default_preset)

    def table(self, preset: Preset, mesh_axes: Iterable[str] = ()) -> dict[str, str | None]:
        """The rules table on a mesh with `mesh_axes`: `preset`'s (see `preset_for`), `rules`,
        sequence parallelism (`sequence` over `model`), and with a `context` axis context
        parallelism (`length` and `sequence` over `context`: the stream between blocks is split
        along the sequence already, and one dimension splits over one mesh axis, so sequence
        parallelism adds nothing there; Placement.from_config says so)."""
        overrides = dict(self.rules or {})
        if CONTEXT_AXIS in mesh_axes:  # (sequence parallelism's split of the stream is context's then)
            overrides.setdefault("length", CONTEXT_AXIS)
            overrides.setdefault("sequence", CONTEXT_AXIS)
        if self.sequence_parallel:
            overrides.setdefault("sequence", "model")
        return rules_table(preset, overrides)

    def update_axis_of(self, preset: Preset) -> str | None:
        """The mesh axis the optimizer state and update are sharded over, if any: `update_axis`
        when set ("": none), else `preset`'s."""
        if self.update_axis is not None:
            return self.update_axis or None
        return preset.update_axis
