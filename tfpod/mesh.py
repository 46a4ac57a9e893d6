"""Mesh specs: "data:-1,model:2" -> a DTensor mesh over every device of the job.

A spec is comma-separated `name:size` pairs in major-to-minor order. At most one
size may be -1; it takes whatever is left of the global device count. The product
of the sizes must equal the global device count.
"""

from __future__ import annotations

import logging
import math
import re

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, runtime

log = logging.getLogger("tfpod")

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_mesh_spec(spec: str, num_devices: int) -> list[tuple[str, int]]:
    """Parses and resolves a mesh spec against a device count.

    Args:
      spec: e.g. "data:-1,model:2".
      num_devices: global number of devices the mesh must cover.

    Returns:
      [(axis_name, size), ...] in spec order, with -1 resolved.

    Raises:
      UserError: malformed spec, duplicate names, more than one -1, or a product
        that does not equal num_devices.
    """
    if not spec or not spec.strip():
        raise UserError("--mesh is empty: give axes like 'data:-1,model:2'")
    axes: list[tuple[str, int]] = []
    for part in spec.split(","):
        name, sep, size_text = part.strip().partition(":")
        name = name.strip()
        if not sep or not _NAME.match(name):
            raise UserError(
                f"--mesh={spec!r}: {part.strip()!r} is not 'name:size' (e.g. 'data:-1,model:2')"
            )
        try:
            size = int(size_text)
        except ValueError:
            raise UserError(
                f"--mesh={spec!r}: size {size_text.strip()!r} of axis {name!r} is not an integer"
            ) from None
        if size == 0 or size < -1:
            raise UserError(
                f"--mesh={spec!r}: axis {name!r} has size {size}; sizes are positive, or -1 for the rest"
            )
        if name in (n for n, _ in axes):
            raise UserError(f"--mesh={spec!r}: axis {name!r} appears twice")
        axes.append((name, size))
    wild = [n for n, s in axes if s == -1]
    if len(wild) > 1:
        raise UserError(f"--mesh={spec!r}: at most one axis may be -1, got {', '.join(wild)}")
    fixed = math.prod(s for _, s in axes if s != -1)
    if wild:
        if num_devices % fixed:
            raise UserError(
                f"--mesh={spec!r}: the fixed axes multiply to {fixed}, which does not divide the "
                f"{num_devices} devices; -1 cannot fill the rest"
            )
        axes = [(n, num_devices // fixed if s == -1 else s) for n, s in axes]
    product = math.prod(s for _, s in axes)
    if product != num_devices:
        raise UserError(
            f"--mesh={spec!r} has {product} devices but the job has {num_devices}: make the sizes "
            f"multiply to {num_devices} (or use -1 on one axis)"
        )
    return axes


def make_mesh(spec: str, device_type: str | None = None) -> dtensor.Mesh:
    """Builds the global DTensor mesh of a spec over all devices of all hosts.

    Args:
      spec: mesh spec, e.g. "data:-1,model:2".
      device_type: defaults to the started runtime's device type.

    Returns:
      A dtensor.Mesh whose dimension names and sizes follow the spec.
    """
    info = runtime.info()
    device_type = device_type or info.device_type
    axes = parse_mesh_spec(spec, info.num_global_devices)
    names = [n for n, _ in axes]
    sizes = [s for _, s in axes]
    if info.num_clients > 1:
        return dtensor.create_distributed_mesh(list(zip(names, sizes)), device_type=device_type)
    return dtensor.create_mesh(list(zip(names, sizes)), device_type=device_type)


def make_stage_meshes(spec: str, device_type: str | None = None) -> list[dtensor.Mesh]:
    """The meshes of a spec: one global mesh, or with a `stage` axis one sub-mesh per
    pipeline stage over the other axes (tfpod.partitioning.stages).

    Raises:
      UserError: as `parse_mesh_spec`, or a host's devices do not divide over the stages.
    """
    from tfpod.partitioning import stages

    info = runtime.info()
    axes = parse_mesh_spec(spec, info.num_global_devices)
    num_stages, rest = stages.split_stage_axis(axes)
    if stages.STAGE_AXIS not in dict(axes):
        return [make_mesh(spec, device_type)]
    if not rest:
        raise UserError(f"--mesh={spec!r}: a stage needs other axes too, e.g. 'stage:2,data:-1'")
    return stages.stage_meshes(rest, num_stages, device_type or info.device_type, info.num_clients, info.client_id,
                               info.num_local_devices, dtensor.job_name())  # (localhost, unless launched as a job)


def axis_size(mesh: dtensor.Mesh, name: str) -> int:
    """Size of a mesh axis (1 when the mesh has no such axis)."""
    return mesh.dim_size(name) if name in mesh.dim_names else 1


def describe(mesh: dtensor.Mesh, global_batch: int, seq_len: int | None, batch_axis: str = "data",
             rows_axis: str | None = None, stages: int = 1, microbatches: int = 1, schedule: str = "gpipe") -> str:
    """One start-up line: the mesh, global batch, per-device batch and tokens per step
    (and how image rows split, when `rows_axis` splits them: the `spatial` preset; and
    the pipeline: `mesh` is then one stage's).

    Raises:
      UserError: the global batch does not divide over the batch axis.
    """
    shards = axis_size(mesh, batch_axis)
    if global_batch % shards:
        raise UserError(
            f"train.global_batch_size={global_batch} does not divide over mesh axis "
            f"{batch_axis!r} of size {shards}: use a multiple of {shards}"
        )
    axes = ",".join(f"{n}:{mesh.dim_size(n)}" for n in mesh.dim_names)
    devices = mesh.size  # (every host's devices)
    if stages > 1:
        axes, devices = f"stage:{stages},{axes}", devices * stages
    text = (
        f"mesh {axes} ({devices} {mesh.device_type()} devices); global batch {global_batch}; per-device batch "
        f"{global_batch // shards} (batch split {shards} ways over {batch_axis!r})"
    )
    if stages > 1 or microbatches > 1:
        text += (f"; {microbatches} microbatches of {global_batch // shards // microbatches} per device"
                 + (f", {stages} pipeline stages ({schedule})" if stages > 1 else " (gradient accumulation)"))
    if rows_axis and axis_size(mesh, rows_axis) > 1:
        text += f"; image rows split {axis_size(mesh, rows_axis)} ways over {rows_axis!r}"
    if seq_len:
        text += f"; tokens per step {global_batch * seq_len}"
    return text


def host_max(values: list[float], mesh: dtensor.Mesh | None = None) -> list[float]:
    """The element-wise max of `values` over every host (a collective over every device of
    `mesh`; default: one axis over all devices). float32: integers are exact below 2**24."""
    mesh = mesh or make_mesh("hosts:-1")
    rank = len(mesh.dim_names)
    layout = dtensor.Layout(list(mesh.dim_names) + [dtensor.UNSHARDED], mesh)  # one row per device
    local = [tf.constant([[float(v) for v in values]], shape=[1] * rank + [len(values)])] * len(mesh.local_devices())
    return [float(v) for v in dtensor.unpack(_max_over_devices(dtensor.pack(local, layout)))[0].numpy()]


def any_host(flag: bool, mesh: dtensor.Mesh | None = None) -> bool:
    """Whether `flag` is true on any host (`host_max` over every device of `mesh`)."""
    return host_max([1.0 if flag else 0.0], mesh)[0] > 0


@tf.function(autograph=False)
def _max_over_devices(x):
    return tf.reduce_max(x, axis=list(range(x.shape.rank - 1)))
