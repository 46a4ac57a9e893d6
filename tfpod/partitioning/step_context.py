"""The traced step's context, and the activation annotations that read it: GShard's split / replicate / shard.

Everything that changes what a traced step computes, beyond its arguments, is one
immutable `StepContext`: the mesh and rules table the annotations lay activations out
on, the number of microbatches the step accumulates and which one is being traced,
which pipeline stage's ops are being built, whether weights read gathered (the `2d`
preset), a stage's prefetched variable copies, and the attention kernel's config
(tfpod.attention). A placement's compile point (`Placement.compile`, and
`Placement.activations` for an eval step) opens it; the executors change one field for
a block of the trace (`within`). Entering a change outside a step is an error, not a
silent no-op. A trace that compiles no step on a placement (single-device export and
serving, Keras's fit, the planner's build) opens a context without a mesh (`tracing`)
for what it sets (its attention); there, as outside any context, the annotations return
their input unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Mapping, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod.partitioning.rules import layout_for


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a step being traced reads besides its arguments (see the module docstring).

    Attributes:
      mesh: the mesh activations are laid out on (a pipeline stage's, inside its stage).
      table: the rules table (logical axis -> mesh axis).
      microbatches: how many microbatches the step accumulates (dropout then needs `microbatch`).
      microbatch: the microbatch being traced (an int, or the accumulation loop's int32 counter).
      stage: the pipeline stage whose ops are being built (None: a step on one mesh).
      gathered: weights installed by `gather_when_used` read gathered (a forward pass).
      prefetched: {(variable id, mesh): its copy on this stage}, made before a tf.cond.
      attention: the attention kernel's config (tfpod.attention.AttentionConfig; None: its
        defaults), read where a model's attention is traced (`tfpod.attention.current`).

    `mesh` is None in a context opened by `tracing` outside a step (nothing is laid out).
    """
    mesh: dtensor.Mesh | None
    table: Mapping[str, str | None]
    microbatches: int = 1
    microbatch: Any = None
    stage: int | None = None
    gathered: bool = False
    prefetched: Mapping = dataclasses.field(default_factory=dict)
    attention: Any = None


_STEP = threading.local()


def current_context() -> StepContext | None:
    """The context of the trace in progress, with a mesh (a step's) or without (`tracing`'s),
    or None outside any."""
    return getattr(_STEP, "value", None)


def active_context() -> StepContext | None:
    """The context of the step being traced on a mesh, or None outside one (and in a context
    without a mesh: `tracing`'s)."""
    context = current_context()
    return None if context is None or context.mesh is None else context


@contextlib.contextmanager
def _entered(context: StepContext | None):
    previous = current_context()
    _STEP.value = context
    try:
        yield context
    finally:
        _STEP.value = previous


def activation_sharding(mesh: dtensor.Mesh, table: Mapping[str, str | None], microbatches: int = 1,
                        **fields) -> contextlib.AbstractContextManager:
    """A step's context on `mesh` with `table` (a placement's compile point opens it):
    within it `shard`/`split`/`replicate` relayout activations on `mesh`."""
    return _entered(StepContext(mesh, dict(table), microbatches, **fields))


def tracing(**fields) -> contextlib.AbstractContextManager:
    """A block of a trace with `fields` (StepContext fields besides the mesh's, e.g.
    `attention=`) set: inside a step's context, that context with them; outside any, a
    context without a mesh that holds only them (the annotations return their input there).
    What a trace that compiles no step on a placement opens: single-device export and
    serving, Keras's fit, the planner's build."""
    context = current_context() or StepContext(mesh=None, table={})
    return _entered(dataclasses.replace(context, **fields))


def within(what: str, **changes) -> contextlib.AbstractContextManager:
    """The enclosing step's context with `changes` (StepContext fields) for a block of the trace.

    Raises:
      RuntimeError: no step is being traced (`what` would silently change nothing).
    """
    context = active_context()
    if context is None:
        raise RuntimeError(f"{what} outside a step's context: trace the step with its placement's compile point "
                           f"(Placement.compile, or inside Placement.activations())")
    return _entered(dataclasses.replace(context, **changes))


def shard(x: tf.Tensor, axes: Sequence[str | None], identity_gradient: bool | None = None) -> tf.Tensor:
    """Annotates an activation with logical axes, one per dimension (GShard `shard`).

    `identity_gradient`: the gradient passes through as it comes instead of DTensor's
    own (RelayoutLike), which fails SPMD expansion downstream of a reshape in a step
    spanning several meshes (a pipeline's; "'tf.Reshape' op CopyToMeshOp must be used to
    send data across mesh"). The values are the same; DTensor lays the gradient out where
    it is used. Default (None): inside a pipeline stage's block of the trace.
    """
    active = active_context()
    if active is None:
        return x
    mesh, table = active.mesh, active.table
    if identity_gradient is None:
        identity_gradient = active.stage is not None
    if len(axes) != x.shape.rank:
        raise ValueError(f"shard: tensor of shape {x.shape} got {len(axes)} logical axes {tuple(axes)}")
    layout = layout_for(axes, table, mesh, x.shape.as_list())
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
    mesh = active.mesh
    specs = [dtensor.UNSHARDED] * x.shape.rank
    if mesh_axis in mesh.dim_names:
        specs[dim] = mesh_axis
    return dtensor.relayout(x, dtensor.Layout(specs, mesh))


def replicate(x: tf.Tensor) -> tf.Tensor:
    """Replicates an activation on every device (GShard `replicate`)."""
    active = active_context()
    if active is None:
        return x
    return dtensor.relayout(x, dtensor.Layout.replicated(active.mesh, x.shape.rank))
