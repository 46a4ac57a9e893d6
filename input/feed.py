"""Host to device: this host's share of the global batch -> one batch-sharded DTensor.

Every host holds the rows of the global batch that belong to its own devices' shards
of the batch axis, in shard order. `host_rows` tells a host how many rows that is
(global_batch / number of hosts when hosts own whole shards); `to_global` packs the
host's rows as the local components of a DTensor over the global mesh
(`dtensor.pack`), so no host ever builds or sends the whole global batch.
"""

from __future__ import annotations

import math

from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.sharding import layout_for


def batch_mesh_axis(axes: Sequence[str | None], table: Mapping[str, str | None], mesh) -> str | None:
    """The mesh axis the first (batch) dimension of a feature with these logical axes is split over."""
    spec = layout_for(axes, table, mesh).sharding_specs
    return None if spec[0] == dtensor.UNSHARDED else spec[0]


def local_shards(mesh: dtensor.Mesh, batch_mesh_axis: str | None) -> list[int]:
    """Indices (along the batch mesh axis) of the batch shards this host's devices hold."""
    if batch_mesh_axis is None:
        return [0]
    return sorted({loc[batch_mesh_axis] for loc in mesh.local_device_locations()})


def host_rows(global_batch: int, mesh: dtensor.Mesh, batch_mesh_axis: str | None, num_hosts: int | None = None) -> int:
    """Rows of the global batch this host must supply.

    Args:
      num_hosts: hosts in the job (None: DTensor's client count).

    Raises:
      UserError: the global batch does not divide over the batch axis or the hosts, or
        the batch axis does not divide over the hosts (two hosts would feed one shard
        from different data).
    """
    shards = mesh.dim_size(batch_mesh_axis) if batch_mesh_axis else 1
    hosts = num_hosts or dtensor.num_clients()
    if global_batch % hosts:
        raise UserError(f"train.global_batch_size={global_batch} does not divide over the {hosts} hosts: "
                        f"use a multiple of {hosts * shards // math.gcd(hosts, shards)}")
    if global_batch % shards:
        raise UserError(
            f"train.global_batch_size={global_batch} does not divide over mesh axis "
            f"{batch_mesh_axis!r} of size {shards}: use a multiple of {shards}"
        )
    if hosts > 1 and shards % hosts:
        raise UserError(f"mesh axis {batch_mesh_axis or 'data'!r} of size {shards} does not divide over the {hosts} "
                        f"hosts, so hosts would feed the same batch shard from different files: make it a multiple "
                        f"of {hosts} (e.g. --mesh=data:-1 with the model axis within a host)")
    return global_batch // shards * len(local_shards(mesh, batch_mesh_axis))


def to_global(
    host_batch: Mapping[str, np.ndarray | tf.Tensor],
    feature_axes: Mapping[str, Sequence[str | None]],
    table: Mapping[str, str | None],
    mesh: dtensor.Mesh,
    leading_dims: int = 0,
) -> dict[str, tf.Tensor]:
    """Packs this host's rows of every feature into global DTensors.

    Args:
      host_batch: {feature: array [*leading, host_rows, ...]}.
      feature_axes: {feature: logical axes of [batch, ...]}; the first is the batch axis.
      table: logical -> mesh axis rules.
      mesh: the global mesh.
      leading_dims: unsharded dimensions before the batch one (e.g. steps of a loop).

    Returns:
      {feature: DTensor with the batch dimension sharded as the rules say}.
    """
    out = {}
    devices = mesh.local_device_locations()
    for name, value in host_batch.items():
        axes = tuple(feature_axes[name])
        batch_axis = batch_mesh_axis(axes, table, mesh)
        layout = layout_for((None,) * leading_dims + axes, table, mesh)
        shards = local_shards(mesh, batch_axis)
        value = tf.convert_to_tensor(value)
        rows = value.shape[leading_dims]
        if rows % len(shards):
            raise UserError(f"feature {name!r}: {rows} host rows do not split over {len(shards)} local batch shards")
        per = rows // len(shards)
        pieces = {}
        components = []
        for loc in devices:
            index = shards.index(loc[batch_axis]) if batch_axis else 0
            if index not in pieces:
                begin = [0] * value.shape.rank
                begin[leading_dims] = index * per
                size = [-1] * value.shape.rank
                size[leading_dims] = per
                pieces[index] = tf.slice(value, begin, size)
            components.append(_shard_other_dims(pieces[index], layout, loc, leading_dims))
        out[name] = dtensor.pack(components, layout)
    return out


def _shard_other_dims(piece: tf.Tensor, layout: dtensor.Layout, loc: Mapping[str, int], leading_dims: int) -> tf.Tensor:
    """Slices non-batch dimensions a rule shards too (e.g. length under sequence parallelism)."""
    for dim, spec in enumerate(layout.sharding_specs):
        if dim == leading_dims or spec == dtensor.UNSHARDED:
            continue
        n = layout.mesh.dim_size(spec)
        size = piece.shape[dim] // n
        begin = [0] * piece.shape.rank
        begin[dim] = loc[spec] * size
        extent = [-1] * piece.shape.rank
        extent[dim] = size
        piece = tf.slice(piece, begin, extent)
    return piece
