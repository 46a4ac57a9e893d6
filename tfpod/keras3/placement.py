"""Host values and DTensors: a value placed piece by piece in a layout, a DTensor gathered.

`place` gives every local device only its piece of a whole value (weights, replicated
values); `place_rows` gives each its rows of this host's part of a batch; `gather` reads a
DTensor of any layout back whole. `check_layout` says in one line why a layout does not fit
a shape, before anything is allocated.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, partitioning


def check_layout(layout: dtensor.Layout, shape: Sequence[int], what: str) -> None:
    """One UserError line when `layout` does not fit a value of `shape` (the rank, or a
    dimension that does not divide over its mesh axis), before anything is allocated."""
    specs = layout.sharding_specs
    if len(specs) != len(shape):
        raise UserError(f"{what} of shape {tuple(shape)} was given a layout of rank {len(specs)} "
                        f"{tuple(None if s == dtensor.UNSHARDED else s for s in specs)}: give one entry per "
                        f"dimension ({len(shape)})")
    for dim, (size, axis) in enumerate(zip(shape, specs)):
        if axis != dtensor.UNSHARDED and size % layout.mesh.dim_size(axis):
            raise UserError(f"{what} of shape {tuple(shape)}: dimension {dim} ({size}) does not divide over mesh axis "
                            f"{axis!r} of size {layout.mesh.dim_size(axis)}: map it to None or another axis in the "
                            "LayoutMap, or change the mesh")


def place(value, layout: dtensor.Layout) -> tf.Tensor:
    """A whole host value as a DTensor of `layout` (each local device gets its piece)."""
    return partitioning.place(np.asarray(value), layout)


def gather(value: tf.Tensor) -> np.ndarray:
    """A DTensor (any layout) as one host array: the whole value."""
    layout = dtensor.fetch_layout(value)
    if not layout.is_fully_replicated():
        value = dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return dtensor.unpack(value)[0].numpy()


def local_shards(layout: dtensor.Layout) -> tuple[str | None, list[int]]:
    """The batch mesh axis of `layout` (None: not split) and the shard indices this host's devices hold."""
    axis = layout.sharding_specs[0]
    if axis == dtensor.UNSHARDED:
        return None, [0]
    return axis, sorted({loc[axis] for loc in layout.mesh.local_device_locations()})


def _device_piece(piece: np.ndarray, layout: dtensor.Layout, loc) -> np.ndarray:
    """The part of one batch shard [rows/shards, ...] a device holds (other split dimensions sliced)."""
    for dim, spec in enumerate(layout.sharding_specs[1:], start=1):
        if spec != dtensor.UNSHARDED:
            size = piece.shape[dim] // layout.mesh.dim_size(spec)
            index = [slice(None)] * piece.ndim
            index[dim] = slice(loc[spec] * size, (loc[spec] + 1) * size)
            piece = piece[tuple(index)]
    return piece


def place_rows(rows: np.ndarray, layout: dtensor.Layout) -> tf.Tensor:
    """This host's rows of a batch [host_rows, ...] as one DTensor of `layout`: the rows are
    as many equal blocks as this host holds batch shards, in shard order, one per shard.

    Raises:
      UserError: the rows do not split into those blocks, or a dimension does not divide.
    """
    axis, shards = local_shards(layout)
    if rows.shape[0] % len(shards):
        raise UserError(f"a batch of {rows.shape[0]} rows on this host does not split over the {len(shards)} "
                        f"shards of mesh axis {axis!r} its devices hold: use a batch size that is a multiple of "
                        f"{layout.mesh.dim_size(axis)} (and drop_remainder=True on several hosts)")
    per = rows.shape[0] // len(shards)
    check_layout(dtensor.Layout([dtensor.UNSHARDED] + layout.sharding_specs[1:], layout.mesh),
                         rows.shape, "an input feature")
    components = []
    for loc in layout.mesh.local_device_locations():
        block = shards.index(loc[axis]) if axis else 0
        components.append(tf.convert_to_tensor(_device_piece(rows[block * per:(block + 1) * per], layout, loc)))
    return dtensor.pack(components, layout)
