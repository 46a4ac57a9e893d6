"""Pipeline stages: the `stage` mesh axis as disjoint sub-meshes, and moving tensors between them.

`--mesh=stage:2,data:2,model:2` splits the devices into 2 stage sub-meshes, each a
`data:2,model:2` mesh: a model's blocks divide into contiguous stages (`stage_sizes`; the
embeddings with the first, the output layer and loss with the last), each stage's
weights and optimizer state live only on its sub-mesh, and activations cross between
stages with `dtensor.copy_to_mesh` inside the compiled step (tfpod.pipeline runs the
schedule).

What DTensor allows, and so how the sub-meshes are drawn (the probes: docs/benchmarks.md):
  * A copy between meshes is of a replicated layout: a batch-sharded tensor is relaid
    out replicated on its mesh, copied, and relaid out on the target mesh (`to_mesh`);
    a direct copy of a sharded layout fails SPMD expansion on CPU and GPU.
  * A copy needs the same hosts on both sides ("Send and receive hosts don't match",
    dtensor_op_spmd_expander.cc): every stage therefore takes an equal share of every
    host's devices (stage s: local devices [s*k, (s+1)*k) of each host, k = local
    devices / stages), and one stage per host is not possible.
  * Each sub-mesh numbers its devices 0..n-1 (ids offset per stage crashed the step
    that copies back and forth: "stack smashing detected").

A variable read on a stage other than its own (the tied embedding the last stage's
output layer multiplies; the step counter dropout and the optimizer read) is copied to
the reading stage (`follow_active_mesh`), and its gradient flows back through the copy.
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, compat
from tfpod.partitioning.step_context import active_context, within

STAGE_AXIS = "stage"


def split_stage_axis(axes: Sequence[tuple[str, int]]) -> tuple[int, list[tuple[str, int]]]:
    """(number of stages, the other axes) of a resolved mesh spec; 1 stage without a `stage` axis."""
    stages = dict(axes).get(STAGE_AXIS, 1)
    return stages, [(n, s) for n, s in axes if n != STAGE_AXIS]


def stage_meshes(axes: Sequence[tuple[str, int]], num_stages: int, device_type: str, num_clients: int,
                 client_id: int, num_local_devices: int, job: str | None = None) -> list[dtensor.Mesh]:
    """The stage sub-meshes: each a mesh of `axes` over an equal share of every host's devices.

    Args:
      axes: [(name, size)] of each stage's mesh (the spec without `stage`).
      num_stages: stages.
      device_type: "CPU", "GPU" or "TPU".
      num_clients, client_id, num_local_devices: the job's hosts, this host, its devices.
      job: the job name (dtensor.job_name(): DTENSOR_JOB_NAME, e.g. a launched job's, even of one
        host; None: localhost for one host, else worker).

    Raises:
      UserError: a host's devices do not divide over the stages.
    """
    if num_local_devices % num_stages:
        raise UserError(f"--mesh: {num_stages} stages over {num_local_devices} devices per host: every stage takes an "
                        f"equal share of each host's devices (DTensor copies between meshes only within a host), so "
                        f"make the stage count divide {num_local_devices}")
    per_host = num_local_devices // num_stages
    names, sizes = [n for n, _ in axes], [s for _, s in axes]
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    local_ids = list(range(client_id * per_host, (client_id + 1) * per_host))

    def device(client: int, index: int) -> str:
        name = job or ("localhost" if num_clients == 1 else "worker")
        return f"/job:{name}/replica:0/task:{client}/device:{device_type}:{index}"

    # (no `global_devices`: copies stay within a host, and DTensor drops them from the
    # mesh it gives a checkpoint's file-name ops, which then no longer match the stage's)
    return [dtensor.Mesh(names, ids, local_ids, [device(client_id, s * per_host + i) for i in range(per_host)])
            for s in range(num_stages)]


def stage_sizes(num_blocks: int, num_stages: int, what: str = "blocks") -> list[int]:
    """How many of the blocks each stage holds: equal runs, or where the stages do not divide
    them, one more on the middle stages first (the first stage also holds the embeddings,
    the last the output layer and loss), then on the first: Llama 3 405B's 126 layers on 16
    stages are 7, 8 x 14, 7, as Meta laid them out.

    Raises:
      UserError: fewer blocks than stages.
    """
    if num_blocks < num_stages:
        raise UserError(f"--mesh: {num_blocks} {what} cannot fill {num_stages} stages: use at most {num_blocks} "
                        "stages (or more layers)")
    base, extra = divmod(num_blocks, num_stages)
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]  # who takes one more
    more = set(order[:extra])
    return [base + (s in more) for s in range(num_stages)]


def same_mesh(a: dtensor.Mesh, b: dtensor.Mesh) -> bool:
    return a is b or a.to_string() == b.to_string()


def to_mesh(x: tf.Tensor, source: dtensor.Mesh, layout: dtensor.Layout) -> tf.Tensor:
    """x (a DTensor on mesh `source`) on `layout`: relaid out replicated, copied, relaid out.

    The copy's gradient is the reverse copy, so gradients flow back to x's stage.
    """
    if same_mesh(source, layout.mesh):
        return dtensor.relayout(x, layout)
    rank = len(layout.sharding_specs)
    replicated = dtensor.relayout(x, dtensor.Layout.replicated(source, rank))
    copied = dtensor.copy_to_mesh(replicated, dtensor.Layout.replicated(layout.mesh, rank))
    return dtensor.relayout(copied, layout)


def scalar_to(x: tf.Tensor, source: dtensor.Mesh, target: dtensor.Mesh) -> tf.Tensor:
    """A scalar on mesh `source` copied to `target`, replicated (its gradient flows back)."""
    return to_mesh(x, source, dtensor.Layout.replicated(target, 0))


def moved(layout: dtensor.Layout, mesh: dtensor.Mesh) -> dtensor.Layout:
    """The same sharding on another stage's mesh."""
    return dtensor.Layout(list(layout.sharding_specs), mesh)


def follow_active_mesh(variable) -> None:
    """Makes reads of a (D)Variable inside another stage's activation context copies on that stage.

    Outside any context (checkpoints, the host loop) and on its own stage a read is the
    variable's value as stored. Inside `prefetched` a read returns the copy made on
    entering it, with no read op: a branch of a tf.cond must stay on one mesh.
    """
    inner = compat.inner_variable(variable)
    home = inner.layout

    def reader(read):
        active = active_context()
        if active is None or same_mesh(active.mesh, home.mesh):
            return read()
        early = active.prefetched.get((id(inner), active.mesh.to_string()))
        if early is not None:
            return early
        return to_mesh(read(), home.mesh, moved(home, active.mesh))

    compat.intercept_variable_reads(inner, reader)


@contextlib.contextmanager
def prefetched(variables: Sequence, mesh: dtensor.Mesh):
    """Within this block of a step's trace, reads of `variables` (made to `follow_active_mesh`) on `mesh`'s stage
    return copies made now, on entering it (before a tf.cond whose branches read them)."""
    values = {}
    active = active_context()
    for v in variables:
        inner = compat.inner_variable(v)
        home = inner.layout
        if not same_mesh(home.mesh, mesh):
            value = inner.read_value()  # a copy on the active stage when it is `mesh`'s (see the reader)
            if active is None or not same_mesh(active.mesh, mesh):
                value = to_mesh(value, home.mesh, moved(home, mesh))
            values[(id(inner), mesh.to_string())] = value
    before = {} if active is None else active.prefetched
    with within("stages.prefetched", prefetched={**before, **values}):
        yield


def stage_index(layout: dtensor.Layout, meshes: Sequence[dtensor.Mesh]) -> int:
    """Which stage's mesh a layout is on."""
    for i, mesh in enumerate(meshes):
        if same_mesh(layout.mesh, mesh):
            return i
    raise ValueError(f"layout on a mesh that is not a stage: {layout.mesh}")


def save_through(variable, mesh: dtensor.Mesh, restored: list, target: dtensor.Layout | None = None,
                 copy=None) -> None:
    """Makes checkpoints write and read `variable` (a DVariable on another stage) on `mesh`.

    One checkpoint save or restore names its files on one mesh (DTensor places the
    file-name ops on the mesh of the first variable its save or restore function holds,
    and an op may not read two meshes), so every stage's variables are saved and read
    through the first stage: when a checkpoint is written or read, each is copied there in
    its own sharding, into a holder variable; a restore reads into the holders, lists
    (variable, holder) in `restored` (the run's, tfpod.train_state.TrainState), and
    `apply_restored(restored)` copies them back. The checkpoint's keys and values are those of an
    unpipelined run, so checkpoints move between pipelined and unpipelined meshes both ways.
    While a checkpoint is written or read, the first stage's devices also hold the other
    stages' state.

    `target` (a layout on `mesh`'s host mesh) and `copy` ((tensor, its mesh, layout) ->
    tensor) hold it otherwise: by default in its own sharding, copied by `to_mesh`.
    """
    inner = compat.inner_variable(variable)
    own = inner.layout
    if same_mesh(own.mesh, mesh):
        return
    host = mesh if mesh.device_type().upper() == "CPU" else mesh.host_mesh()
    target = target or moved(own, host)
    copy = copy or to_mesh

    class Saveable(compat.saveable_object_class()):
        def __init__(self, name):
            # made eagerly, now: TF's save and restore functions then hold no variable of another stage
            self.holder = dtensor.DVariable(copy(inner.read_value(), own.mesh, target), trainable=False)
            n = host.num_local_devices()
            scalar = dtensor.Layout.replicated(host, 0)
            spec = compat.dtensor_save_spec()(
                tensor=self.holder.read_value,
                slice_spec=dtensor.pack([""] * n, scalar), name=dtensor.pack([name] * n, scalar),
                global_shape=inner.shape, layout=target.to_string(), dtype=inner.dtype, device=inner.device)
            super().__init__(None, [spec], name)

        def restore(self, restored_tensors, restored_shapes):
            del restored_shapes
            restored.append((inner, self.holder, copy))
            return self.holder.assign(restored_tensors[0])

    compat.set_checkpoint_saveable(inner, Saveable)


def apply_restored(restored: list) -> None:
    """Copies what the latest checkpoint restore read into the first stage's holders (the
    pairs `save_through` listed in `restored`) to their variables on the other stages."""
    while restored:
        inner, holder, copy = restored.pop()
        inner.assign(copy(holder.read_value(), holder.layout.mesh, inner.layout))
