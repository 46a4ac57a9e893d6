"""The Preset: one object that answers everything a run asks of a named way to shard.

A preset gives its rules table (logical axis -> mesh axis; an axis it does not name is
replicated), the mesh axis the optimizer state and update are sharded over, the mesh
axis whose weight shards are gathered where a layer uses them, whether `--mesh=auto`
tries it, and its checks against the task, pipeline stages and the Keras front end.
The checks read the run's final table (the preset's with `sharding.rules` applied), so
a rule that splits image rows is checked as the `spatial` preset is. A preset with
other limits subclasses Preset and extends a check.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Mapping

from tfpod import UserError

# Megatron-LM's tensor parallelism: attention heads (and grouped-query attention's key/value
# heads where they divide, else replicated) and the MLP's hidden units over `model`
# (column-parallel into a block, row-parallel out of it), the vocabulary over `model`
# (vocab-parallel embedding and output layer), MoE experts over `expert`.
MEGATRON = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model", "expert": "expert"}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named rules table and what comes with it.

    Attributes:
      name: `sharding.preset='<name>'` picks it.
      table: {logical axis: mesh axis}; logical axes not named are replicated.
      summary: one line for the docs and `--mode=plan`'s listing.
      update_axis: mesh axis the optimizer state and update are sharded over (None: laid
        out like each weight); `sharding.update_axis` overrides it.
      gather_axis: mesh axis whose weight shards are gathered where a layer uses them
        (None: weights are used as stored).
      searched: whether `--mesh=auto` tries it (see `tried_on`).
    """

    name: str
    table: Mapping[str, str]
    summary: str
    update_axis: str | None = None
    gather_axis: str | None = None
    searched: bool = True

    def tried_on(self, mesh_axes: Collection[str]) -> bool:
        """Whether `--mesh=auto` tries this preset on a mesh with these axes: a searched preset
        that uses only `data`, shards the update, or maps something to an axis of the mesh
        besides `data` (elsewhere it would repeat a preset that uses less)."""
        beyond = set(self.table.values()) - {"data"}
        return self.searched and (not beyond or self.update_axis is not None or bool(beyond & set(mesh_axes)))

    def check_run(self, task, placement, tasks: Mapping[str, object] = ()) -> None:
        """Refuses, in one UserError line, a run this preset's table cannot give `task` on `placement`.

        Args:
          task: the run's Task (its declared capabilities: `splits_image_rows`).
          placement: the run's Placement (its final table, update and gather axes, stages).
          tasks: the registry {name: Task}, to name the models that can (optional).
        """
        rows = _split_image_rows(placement.table, placement.mesh)
        if rows and not task.splits_image_rows:
            able = ", ".join(sorted(n for n, t in dict(tasks).items() if t.splits_image_rows)) or "image models"
            raise UserError(f"sharding: image rows (logical axis 'height') over mesh axis {rows!r}, from the spatial "
                            f"preset or sharding.rules, but model {task.name!r} has no image rows to split: spatial "
                            f"partitioning is for {able}; use another preset (e.g. tensor or data)")
        if placement.stages and (placement.gather_axis or placement.update_axis):
            what = (f"sharding.preset={self.name!r}" if placement.gather_axis
                    else f"an update sharded over {placement.update_axis!r}")
            raise UserError(f"{what} inside pipeline stages (--mesh with a `stage` axis) is not supported yet: "
                            f"DTensor computes its data-sharded weights' gradients wrongly in a step that spans the "
                            f"stage meshes (a gather of a sharded table reads out of range); use the data or tensor "
                            f"preset in the stages (sharding.update_axis='' turns weight_update's sharded update off)")

    def check_keras(self, table: Mapping[str, str | None], mesh) -> None:
        """Refuses, in one UserError line, what the Keras front end (tfpod.sharding) cannot honour
        with this preset and final `table` on `mesh`."""
        rows = _split_image_rows(table, mesh)
        if rows:
            raise UserError(
                f"tfpod.sharding: image rows (logical axis 'height') over mesh axis {rows!r}, from preset "
                f"{self.name!r} or overrides: a Keras model's layers do not split image rows here (the spatial "
                "preset is for tfpod's resnet and ssd through main.py); use preset='data' or 'tensor'")
        if self.update_axis:
            raise UserError(
                f"tfpod.sharding: preset {self.name!r} shards the optimizer update over {self.update_axis!r}, which "
                f"the Keras front end does not do (Keras's optimizer keeps each slot laid out like its weight); use "
                f"a preset with the same layouts and a whole update (e.g. 'tensor'), or train through main.py")


def _split_image_rows(table: Mapping[str, str | None], mesh) -> str | None:
    """The mesh axis of more than one device the table splits image rows over, if any."""
    axis = table.get("height")
    return axis if axis in mesh.dim_names and mesh.dim_size(axis) > 1 else None
