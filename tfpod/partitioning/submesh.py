"""Sub-meshes of one position of a mesh axis, and copies between a mesh and such a sub-mesh.

`at(mesh, axis, p)` is the devices of `mesh` at position p of `axis`: a mesh of the same
axes with `axis` of size 1, its devices numbered 0..n-1 in the main mesh's order (as stage
meshes are, tfpod.partitioning.stages). Embedding tables placed whole live on such
sub-meshes (tfpod.embedding.whole).

`copy` moves a tensor between the mesh and one of its sub-meshes eagerly, by pieces: the
sub-mesh devices are the mesh's own, so each device's piece is sliced from, or
concatenated out of, the pieces on devices of this host that share its coordinates on the
other axes. No DTensor copy between meshes of different sizes is involved (one hung:
`copy_to_mesh` from a 4-device sub-mesh to its 8-device mesh never returned), and no
device holds more than its own piece and the pieces it is made from.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError


def at(mesh: dtensor.Mesh, axis: str, position: int) -> dtensor.Mesh:
    """The devices of `mesh` at `position` of `axis` (see the module docstring).

    Raises:
      UserError: this host has no device there.
    """
    names = list(mesh.dim_names)
    ids = np.asarray(mesh.global_device_ids()).reshape([mesh.dim_size(n) for n in names])
    chosen = np.take(ids, [position], axis=names.index(axis))
    renumber = {int(g): i for i, g in enumerate(chosen.reshape(-1))}
    local = [(renumber[g], d) for g, d in zip(mesh.local_device_ids(), mesh.local_devices()) if g in renumber]
    if not local:
        raise UserError(f"position {position} of mesh axis {axis!r} has no device on this host, and every host takes "
                        f"part in what lives there; use an axis every host has devices at each position of (one "
                        f"that splits inside a host)")
    return dtensor.Mesh(names, np.arange(chosen.size).reshape(chosen.shape), [i for i, _ in local],
                        [d for _, d in local])


def canonical(name: str) -> str:
    """A device name in one spelling (DTensor's and TensorFlow's differ in form)."""
    return tf.DeviceSpec.from_string(name).to_string()


def position(sub: dtensor.Mesh, mesh: dtensor.Mesh) -> tuple[str, int] | None:
    """(axis, position) of `sub` when it is a sub-mesh `at` one position of an axis of `mesh`;
    None for `mesh` itself (or a mesh of its size)."""
    if sub.size == mesh.size:
        return None
    for axis in mesh.dim_names:
        if sub.dim_size(axis) == 1 and mesh.dim_size(axis) > 1:
            locations = dict(zip(map(canonical, mesh.local_devices()), mesh.local_device_locations()))
            return axis, locations[canonical(sub.local_devices()[0])][axis]
    return None


def _pieces(x: tf.Tensor, mesh: dtensor.Mesh, axis: str) -> dict:
    """{(device coordinates other than `axis`): [(its coordinate on `axis`, this host's piece)]}."""
    out = {}
    for piece, loc in zip(dtensor.unpack(x), mesh.local_device_locations()):
        out.setdefault(tuple(sorted((k, v) for k, v in loc.items() if k != axis)), []).append((loc[axis], piece))
    return out


def copy(x: tf.Tensor, source: dtensor.Mesh, layout: dtensor.Layout, axis: str) -> tf.Tensor:
    """`x` (a DTensor on `source`) on `layout`, where one of the two meshes is a sub-mesh `at`
    a position of `axis` of the other and the layouts split the other dimensions alike.

    Only the first dimension may differ in how it splits: over `axis` on the mesh, or not
    at all (the sub-mesh's `axis` is of size 1).

    Raises:
      UserError: a piece's sources are on another host.
    """
    target = layout.mesh
    src_split = dtensor.fetch_layout(x).sharding_specs[0] == axis
    dst_split = layout.sharding_specs[0] == axis
    pieces = _pieces(x, source, axis)
    size = target.dim_size(axis) if dst_split else 1
    out = []
    for device, loc in zip(target.local_devices(), target.local_device_locations()):
        key = tuple(sorted((k, v) for k, v in loc.items() if k != axis))
        if key not in pieces:
            raise UserError(f"copying between a mesh and its sub-mesh over {axis!r}: device {device}'s piece is on "
                            "another host; use an axis that splits inside a host")
        found = sorted(pieces[key], key=lambda cp: cp[0])
        if src_split and len(found) != source.dim_size(axis):
            raise UserError(f"copying between a mesh and its sub-mesh over {axis!r}: device {device}'s rows are "
                            "partly on another host; use an axis that splits inside a host")
        with tf.device(device):
            whole = tf.concat([p for _, p in found], axis=0) if src_split else found[0][1]
            if dst_split:
                per = whole.shape[0] // size
                whole = whole[loc[axis] * per:(loc[axis] + 1) * per]
            out.append(tf.identity(whole))
    return dtensor.pack(out, layout)
