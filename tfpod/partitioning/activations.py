"""Activation annotations inside the compiled step: GShard's split / replicate / shard.

Within `activation_sharding(mesh, table)` the helpers relayout an activation on the
mesh; outside it (single-device export, plain Keras) they return their input unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Mapping, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod.partitioning.rules import layout_for

# Activation annotations (GShard's split / replicate, inside the compiled step)

_ACTIVE = threading.local()


@contextlib.contextmanager
def scoped(store: threading.local, name: str, value):
    """Sets `store.<name>` to `value` inside the context, restoring what it was after (the
    thread-local switches of partitioning: gathered weights, a pipeline stage, a microbatch)."""
    previous = getattr(store, name, None)
    setattr(store, name, value)
    try:
        yield
    finally:
        setattr(store, name, previous)


@contextlib.contextmanager
def activation_sharding(mesh: dtensor.Mesh, table: Mapping[str, str | None]):
    """Within this context `shard`/`split`/`replicate` relayout activations on `mesh`.

    Outside it (single-device export, plain Keras) they return their input unchanged.
    """
    prev = getattr(_ACTIVE, "value", None)
    _ACTIVE.value = (mesh, dict(table))
    try:
        yield
    finally:
        _ACTIVE.value = prev


def active_context():
    """(mesh, table) of the enclosing `activation_sharding` context, or None outside one."""
    return getattr(_ACTIVE, "value", None)


def shard(x: tf.Tensor, axes: Sequence[str | None], identity_gradient: bool = False) -> tf.Tensor:
    """Annotates an activation with logical axes, one per dimension (GShard `shard`).

    `identity_gradient`: the gradient passes through as it comes instead of DTensor's
    own (RelayoutLike), which fails SPMD expansion downstream of a reshape in a step
    spanning several meshes (a pipeline's; "'tf.Reshape' op CopyToMeshOp must be used to
    send data across mesh"). The values are the same; DTensor lays the gradient out where
    it is used.
    """
    active = active_context()
    if active is None:
        return x
    mesh, table = active
    if len(axes) != x.shape.rank:
        raise ValueError(f"shard: tensor of shape {x.shape} got {len(axes)} logical axes {tuple(axes)}")
    layout = layout_for(axes, table, mesh)
    if not identity_gradient:
        return dtensor.relayout(x, layout)

    @tf.custom_gradient
    def relaid(x):
        return dtensor.relayout(x, layout), lambda dy: dy

    return relaid(x)


def split(x: tf.Tensor, dim: int, mesh_axis: str) -> tf.Tensor:
    """Splits one dimension of an activation over a mesh axis, others replicated (GShard `split`)."""
    active = active_context()
    if active is None:
        return x
    mesh, _ = active
    specs = [dtensor.UNSHARDED] * x.shape.rank
    if mesh_axis in mesh.dim_names:
        specs[dim] = mesh_axis
    return dtensor.relayout(x, dtensor.Layout(specs, mesh))


def replicate(x: tf.Tensor) -> tf.Tensor:
    """Replicates an activation on every device (GShard `replicate`)."""
    active = active_context()
    if active is None:
        return x
    mesh, _ = active
    return dtensor.relayout(x, dtensor.Layout.replicated(mesh, x.shape.rank))
