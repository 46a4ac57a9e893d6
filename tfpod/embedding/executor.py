"""The executor of a model with embedding tables: OneMesh's step with the tables' lookups
before it and their sparse row updates after it.

A step with tables is three calls per batch (tfpod.embedding.tables says why the tables'
work runs outside the DTensor program):

  1. `Tables.lookup`: each device's partial lookups from its own shards (an ordinary
     TensorFlow function over the local devices), written on each device into DVariables
     of their layouts (`Tables.hold`) that the step reads into its batch (`PARTIALS` + the
     table's name): no DTensor is packed between steps;
  2. the compiled step, the Trainer's one step body (on a mesh of one device, DTensor's
     program of it called directly once DTensor has made it: `_CompiledStep`): OneMesh's
     loss and gradients in the lookup scope of those partials, each table's gradient kept
     as rows (`Accumulation`'s `sparse`), gathered replicated and de-duplicated
     (`sparse.dedupe`); then `optimizers.Update.step` with `TableHomes`
     (tfpod.embedding.homes): the norm over the dense gradients and the de-duplicated rows,
     clipping, the dense weights' update when finite, and the scaled rows with
     [lr, finite, step] returned by the compiled step;
  3. `Tables.apply_local`: every device updates its shards' touched rows and slots in place
     (nothing when the step was not finite), fused with the next step's lookups into
     those DVariables.

A table placed whole on a sub-mesh (sharding.tables='whole', tfpod.embedding.whole) is
never read by the step (one DTensor program takes one mesh's variables): its layer reads
the table's marker, a scalar on the step's mesh, which stands in for it among the step's
variables, and its rows come back as the marker's gradient.

The loop runs the steps one call each on the host (the lookups and updates sit between
them) and fetches the losses and norms once at its end. Evaluation packs each batch's
partial lookups the same way and runs the forward pass in their lookup scope.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, compat, optimizers, runtime
from tfpod.embedding.homes import TableHomes
from tfpod.embedding.layer import lookup_scope
from tfpod.embedding.sparse import Rows, dedupe
from tfpod.embedding import whole
from tfpod.embedding.tables import Held, Tables, find_layers
from tfpod.executor import LoopFn, OneMesh, StepFn
from tfpod.partitioning import Placement, submesh, var_name
from tfpod.task import Task

PARTIALS = "__table__/"  # a packed batch's features holding a table's partial lookups


def check_supported(placement: Placement, microbatches: int) -> None:
    """Refuses (one UserError line) what the tables' sparse path does not do yet."""
    if microbatches > 1:
        raise UserError(f"train.microbatches={microbatches} with embedding tables is not supported yet: the tables' "
                        "rows are applied once per batch; use train.microbatches=1")
    if placement.num_stages > 1:
        raise UserError("pipeline stages (a `stage` mesh axis) with embedding tables are not supported: drop the "
                        "stage axis")
    if placement.update_axis:
        raise UserError("a sharded optimizer update (weight_update preset, sharding.update_axis) with embedding "
                        "tables is not supported yet: set sharding.update_axis='' or use the data or tensor preset")


def _split(batch: Mapping[str, tf.Tensor]) -> tuple[dict, dict]:
    """A packed batch -> (its features, {table name: partial lookups})."""
    features = {k: v for k, v in batch.items() if not k.startswith(PARTIALS)}
    partials = {k[len(PARTIALS):]: v for k, v in batch.items() if k.startswith(PARTIALS)}
    return features, partials


class _CompiledStep:
    """One shapes' compiled step, reading the lookups in `held`, and how it is called: through
    DTensor; or, on a mesh of one device, once DTensor has expanded it for any index into the
    loop's batches, that program called directly (compat.dtensor_local_program: ~0.5 ms a step
    less of DTensor's dispatch). DTensor's first expansion folds the first index in as a
    constant; a call with another index (a loop call's second step) makes the one that takes
    it. A call returns (loss, norm, rows, hyper) with the rows and hyper as their components
    on this host's devices (for Tables.apply_local)."""

    TRIES = 2  # calls with an index past the first after which the direct program is looked for

    def __init__(self, compiled, stacked: Mapping, index: tf.Tensor, held: Held, one_device: bool):
        self.held, self.compiled = held, compiled
        self.concrete = compiled.concrete(stacked, index)
        self.through_dtensor = compat.flat_caller(self.concrete, stacked, index)
        self.direct = None
        self.tries = self.TRIES if one_device else 0

    def tracing_count(self) -> int:
        return self.compiled.experimental_get_tracing_count()

    def __call__(self, stacked: Mapping, index: tf.Tensor, first: bool, components) -> tuple:
        """`first`: whether the index is a loop call's first; `components()`: the arguments'
        components (only called for the direct program)."""
        if self.direct is not None:
            out = self.direct(*components())
            return out[0], out[1], [([i], [v]) for i, v in zip(out[2:-1:2], out[3:-1:2])], [out[-1]]
        loss, norm, rows, hyper = self.through_dtensor(stacked, index)
        if self.tries and not first:
            self.tries -= 1
            self.direct = compat.dtensor_local_program(self.concrete, tf.nest.flatten((stacked, index)), "_direct")
            # (its flat outputs are read as loss, norm, each table's ids and values, hyper)
            assert len(tf.nest.flatten(self.concrete.structured_outputs)) == 3 + 2 * len(rows)
        return loss, norm, [(dtensor.unpack(i), dtensor.unpack(v)) for i, v in rows], dtensor.unpack(hyper)


class TablesExecutor(OneMesh):
    """OneMesh for a model with tfpod.embedding tables (a task with `sparse_tables`): each
    step's lookups, the compiled step and the tables' sparse update (module docstring).

    Args:
      task: the task.
      placement: the run's placement (no stages, no sharded update).
      microbatches: 1 (the tables' rows are applied once per batch).

    Raises:
      UserError: microbatches, pipeline stages or a sharded update, which tables do not take yet.
    """

    def __init__(self, task: Task, placement: Placement, microbatches: int = 1):
        check_supported(placement, microbatches)
        super().__init__(task, placement, microbatches)
        self.tables: Tables | None = None
        self._homes: TableHomes | None = None
        self._positions: list[int] = []  # the tables' positions among the update's variables
        self._order: list[int] = []  # per table of `tables`, its index among those positions
        self._widths: list[int] = []  # per position, the table's row width

    def bind(self, model, update: optimizers.Update, state) -> None:
        """Also finds the model's tables and their shards on this host's devices (`Tables`)."""
        super().bind(model, update, state)
        self.tables = Tables(model, self.placement, self.task.batch_axes(), update.optimizer)
        if not self.tables:
            raise UserError(f"task {self.task.name!r} declares sparse_tables but its model has no tfpod.embedding "
                            "table: drop the capability, or build the tables with tfpod.embedding.Embedding")
        inner = lambda v: id(compat.inner_variable(v))
        ids = {inner(t.variable) for t in self.tables.tables}
        self._positions = [j for j, v in enumerate(self.variables) if inner(v) in ids]
        by_variable = {inner(self.variables[j]): n for n, j in enumerate(self._positions)}
        self._order = [by_variable[inner(t.variable)] for t in self.tables.tables]
        self._widths = [self.variables[j].shape[-1] for j in self._positions]
        for t in self.tables.tables:  # a whole table on another mesh: the step differentiates its marker
            if t.marker is not None:
                self.variables[self._positions[by_variable[inner(t.variable)]]] = t.marker
                if state is not None:
                    self._save_through_step_mesh(t, update, state)
        self.sparse = frozenset(id(self.variables[j]) for j in self._positions)
        self._homes = TableHomes(self._positions)

    def _save_through_step_mesh(self, table, update: optimizers.Update, state) -> None:
        """A checkpoint's save or restore names its files on one mesh: a whole table and its
        slots are written and read through the step's (as pipeline stages' are), held there in
        the rules' layout (rows over the table's axis, so no device holds the whole table for
        it) and copied piece by piece (partitioning.submesh.copy)."""
        mesh, axis = self.placement.mesh, table.row_axis
        variables = [table.variable] + [update.optimizer.get_slot(table.variable, n) for n in table.rule.slots]
        state.save_through(variables, mesh, lambda v: dtensor.Layout([axis] + list(v.layout.sharding_specs[1:]), mesh),
                           lambda x, source, layout: submesh.copy(x, source, layout, axis))

    def variable_layouts(self, model, layouts: Mapping) -> dict:
        """With sharding.tables='whole': each table's layout on its position's sub-mesh
        (tfpod.embedding.whole); else none (the rules' layouts)."""
        if self.placement.tables != "whole":
            return {}
        tables = {var_name(t.embeddings): compat.inner_variable(t.embeddings) for t in find_layers(model)}
        return whole.layouts(list(tables), layouts, {n: tuple(v.shape) for n, v in tables.items()},
                             {n: v.dtype.size for n, v in tables.items()}, self.placement.mesh)

    @property
    def homes(self) -> TableHomes:
        return self._homes

    def to_device(self, host_stack: Mapping[str, np.ndarray], num_steps: int) -> tuple[dict, list]:
        """(every step's batch on the mesh, per table its global ids of each step [batch, hot]),
        made once: one tensor per step, so no step converts its ids on the host (~60 us a table)."""
        ids = self.tables.global_ids(host_stack, leading_dims=1)
        return super().to_device(host_stack, num_steps), [tf.unstack(tf.convert_to_tensor(i)) for i in ids]

    def loss_and_gradients(self, batch: Mapping[str, tf.Tensor]) -> tuple[tf.Tensor, list]:
        """OneMesh's, in the lookup scope of the batch's partial lookups; each table's gradient
        is its `Rows`, gathered replicated and de-duplicated."""
        features, partials = _split(batch)
        with lookup_scope(self.tables.scope(partials)):
            loss, grads = super().loss_and_gradients(features)
        mesh = self.placement.mesh
        replicated = lambda t: dtensor.relayout(t, dtensor.Layout.replicated(mesh, t.shape.rank))
        for j, width in zip(self._positions, self._widths):
            g, v = grads[j], self.variables[j]
            if g is None:  # not looked up in this step
                rows = Rows(tf.zeros([0], tf.int32), tf.zeros([0, width], v.dtype))
            else:
                rows = Rows(tf.cast(g.indices, tf.int32), g.values)
            grads[j] = dedupe(Rows(replicated(rows.ids), replicated(rows.values)))
        return loss, grads

    def make_loop(self, step: StepFn, steps_per_loop: int) -> LoopFn:
        """The host loop: each step's compiled call (on a mesh of one device, from the first
        loop call's third step on, DTensor's program of it called directly: `_CompiledStep`),
        then its rows applied to the shards in the same call as the next step's lookups; the
        losses and norms fetched once at the end. (TensorFlow's asynchronous eager execution
        would overlap the host's calls with the device's work, but it does not keep the
        DTensor step after the ordinary update function whose writes it reads: tried,
        dlrm_tiny's AUC fell to 0.852, 0.016 below its teacher's.)"""
        del steps_per_loop  # one compiled call per step, as many as the packed steps asked for
        tables, homes, order = self.tables, self._homes, self._order

        mesh = self.placement.mesh
        indices = []  # step n's index into a loop call's batches, on the mesh (made once: no copy per step)
        local_indices = []  # and its component, for a direct call

        def index(n: int) -> tf.Tensor:
            while len(indices) <= n:
                indices.append(dtensor.copy_to_mesh(tf.constant(len(indices)), dtensor.Layout.replicated(mesh, 0)))
                local_indices.append(dtensor.unpack(indices[-1])[0])
            return indices[n]

        def train_step_reading(held: Held):
            def train_step(stacked, index):
                batch = {k: tf.gather(v, index) for k, v in stacked.items()}
                batch.update({PARTIALS + name: p for name, p in held.read().items()})
                loss, norm = step(batch)
                rows, hyper = homes.take()
                return loss, norm, rows, hyper
            return train_step

        loops = {}  # per shapes of a loop call's inputs: its _CompiledStep
        one_device = mesh.size == 1

        def run(packed, num_steps: int):
            stacked, ids = packed
            first = [i[0] for i in ids]
            key = (tuple((k, tuple(v.shape)) for k, v in sorted(stacked.items())), tuple(tuple(i.shape) for i in first))
            if key in loops:
                tables.lookup_into(first, loops[key].held)
            else:
                held = tables.hold(first)
                loops[key] = _CompiledStep(self.placement.compile(train_step_reading(held)), stacked, index(0), held,
                                           one_device)
            compiled = loops[key]
            batches = []  # the stacked batches' components, for a direct call (made once a loop call)

            def components(n):
                if not batches:
                    batches.extend(dtensor.unpack(x)[0] for x in tf.nest.flatten(stacked))
                return batches + [local_indices[n]]

            losses, norms = [], []
            for n in range(num_steps):
                loss, norm, rows, hyper = compiled(stacked, index(n), n == 0, lambda: components(n))
                following = [i[n + 1] for i in ids] if n + 1 < num_steps else None
                tables.apply_local([rows[p] for p in order], hyper, following, compiled.held)  # + the next lookups
                losses.append(loss)
                norms.append(norm)
            return (np.array([runtime.to_host(x) for x in losses], np.float32),
                    np.array([runtime.to_host(x) for x in norms], np.float32))

        run.experimental_get_tracing_count = lambda: sum(c.tracing_count() for c in loops.values())
        return run

    def eval_to_device(self, host_batch: Mapping[str, np.ndarray]) -> dict[str, tf.Tensor]:
        """The batch on the mesh and the tables' partial lookups of its ids."""
        out = super().eval_to_device(host_batch)
        out.update({PARTIALS + name: p for name, p in self.tables.lookup(host_batch).items()})
        return out

    def eval_forward(self, batch: Mapping[str, tf.Tensor]) -> tuple[tf.Tensor, Mapping]:
        features, partials = _split(batch)
        with lookup_scope(self.tables.scope(partials)):
            return super().eval_forward(features)
