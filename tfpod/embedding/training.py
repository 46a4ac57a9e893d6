"""Training steps with embedding tables: the dense update in the step, the tables' rows after it.

A step with tables is three calls per batch (tfpod.embedding.tables explains why the
tables' work runs outside the DTensor program):

  1. `Tables.lookup`: each device's partial lookups from its own shards (an ordinary
     TensorFlow function over the local devices), packed as DTensors;
  2. the compiled step (`sparse_step` at its end): forward, loss and gradients as any
     step; each table's gradient arrives as rows (tfpod.embedding.layer records them),
     is gathered replicated and de-duplicated (`sparse.dedupe`); the global norm counts
     every weight's squares and each table's de-duplicated rows' squares (the norm of
     the table's dense gradient, as if it were dense; duplicates summed first, not
     counted one by one as tf.clip_by_global_norm does on IndexedSlices); clipping
     scales both; the dense weights' update runs only when the loss and the norm are
     finite, and the rows leave the step scaled, with [lr, finite, step];
  3. `Tables.apply`: every device updates its shards' touched rows and slots in place
     (nothing when the step was not finite; the step counter advances either way, as
     `optimizers.Update.step` does).

The outer loop runs the steps one call each on the host (the lookups and updates sit
between them), fetching losses and norms once at the end of the loop.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, compat, partitioning, runtime
from tfpod.embedding.layer import active_scope, lookup_scope
from tfpod.embedding.sparse import Rows, dedupe, squared_norm


def with_rows(variables: Sequence, grads: Sequence) -> list:
    """The gradients of a step's weights: dense tensors (IndexedSlices densified), and for a
    table looked up through the step's lookup scope its `Rows` (never densified). The hook of
    the executor (tfpod.trainer.accumulate) after it takes gradients."""
    scope = active_scope()
    tables = scope.table_layers if scope is not None else {}
    out = []
    for v, g in zip(variables, grads):
        if id(compat.inner_variable(v)) not in tables:
            out.append(tf.convert_to_tensor(g))
        elif g is None:  # not looked up in this step
            out.append(Rows(tf.zeros([0], tf.int32), tf.zeros([0, v.shape[-1]], v.dtype)))
        else:
            out.append(Rows(tf.cast(g.indices, tf.int32), g.values))
    return out


def sparse_step(update, loss: tf.Tensor, grads: Sequence, clip_norm: float | None, mesh):
    """The update of a step whose gradients include tables' rows (inside the compiled step).

    Args:
      update: the run's optimizers.Update (dense weights' update).
      loss: the step's loss.
      grads: per variable of `update.variables`: a dense gradient, or a table's `Rows`.
      clip_norm: global-norm clipping (None or 0: off).
      mesh: the mesh (the rows are gathered replicated on it).

    Returns:
      (loss, norm, [(ids, values) per table, in variable order], hyper [lr, finite, step]).
    """
    replicated = lambda t: dtensor.relayout(t, dtensor.Layout.replicated(mesh, t.shape.rank))
    dense = [j for j, g in enumerate(grads) if not isinstance(g, Rows)]
    tables = [j for j, g in enumerate(grads) if isinstance(g, Rows)]
    rows = {j: dedupe(Rows(replicated(grads[j].ids), replicated(grads[j].values))) for j in tables}
    squares = [tf.reduce_sum(tf.square(tf.cast(grads[j], tf.float32))) for j in dense]
    squares += [squared_norm(rows[j]) for j in tables]
    norm = tf.sqrt(tf.add_n(squares))
    finite = tf.math.is_finite(loss) & tf.math.is_finite(norm)
    scale = tf.constant(1.0)
    if clip_norm:
        scale = clip_norm / tf.maximum(norm, clip_norm)
    optimizer = update.optimizer
    lr = tf.cast(compat.decayed_lr(optimizer), tf.float32)  # at this step, before the counter advances
    step = tf.cast(optimizer.iterations + 1, tf.float32)
    hyper = tf.stack([lr, tf.cast(finite, tf.float32), step])
    with tf.control_dependencies([hyper]):
        scaled = [None] * len(grads)
        for j in dense:
            scaled[j] = grads[j] * tf.cast(scale, grads[j].dtype)

        def skip():
            optimizer.iterations.assign_add(1)

        tf.cond(finite, lambda: update.apply(scaled, dense), skip)
    outputs = [(rows[j].ids, rows[j].values * tf.cast(scale, rows[j].values.dtype)) for j in tables]
    return loss, norm, outputs, hyper


def check_supported(update, placement, microbatches: int) -> None:
    """Refuses (one UserError line) what the tables' sparse path does not do yet."""
    if microbatches > 1:
        raise UserError(f"train.microbatches={microbatches} with embedding tables is not supported yet: the tables' "
                        "rows are applied once per batch; use train.microbatches=1")
    if placement.num_stages > 1:
        raise UserError("pipeline stages (a `stage` mesh axis) with embedding tables are not supported: drop the "
                        "stage axis")
    if update.sharded:
        raise UserError("a sharded optimizer update (weight_update preset, sharding.update_axis) with embedding "
                        "tables is not supported yet: set sharding.update_axis='' or use the data or tensor preset")


def make_train_loop(loss_and_gradients, update, clip_norm: float | None, steps_per_loop: int, placement,
                    tables, feature_axes: Mapping[str, Sequence]):
    """The training loop of a model with tables: each step a lookup, the compiled step and the
    tables' update, run from the host.

    Returns:
      fn(host_stack, num_steps) -> (losses [num_steps], norms [num_steps]) as host arrays;
      `host_stack` is this host's stacked batches [steps_per_loop, rows, ...].
    """
    mesh = placement.mesh
    table_ids = {id(compat.inner_variable(t.variable)) for t in tables.tables}
    order = [j for j, v in enumerate(update.variables) if id(compat.inner_variable(v)) in table_ids]
    by_position = {id(compat.inner_variable(update.variables[j])): n for n, j in enumerate(order)}
    positions = [by_position[id(compat.inner_variable(t.variable))] for t in tables.tables]

    def train_step(stacked, index, partials):
        if partitioning.active_context() is None:
            raise RuntimeError("the train step was traced outside a placement's activation context")
        batch = {k: tf.gather(v, index) for k, v in stacked.items()}
        with lookup_scope(tables.scope(partials)):
            loss, grads = loss_and_gradients(batch)
            return sparse_step(update, loss, grads, clip_norm, mesh)

    step = placement.compile(train_step)

    def host_loop(host_stack, num_steps: int):
        stacked = placement.to_global(host_stack, feature_axes, leading_dims=1)  # every step's batch, once
        ids = tables.global_ids(host_stack, leading_dims=1)  # [steps, batch, hot] per table
        partials = tables.lookup_ids([i[0] for i in ids])
        losses, norms = [], []
        for n in range(num_steps):
            loss, norm, rows, hyper = step(stacked, tf.constant(n), partials)
            # this step's rows, then the next step's lookups, in one call
            following = [i[n + 1] for i in ids] if n + 1 < num_steps else None
            partials = tables.apply([rows[p] for p in positions], hyper, following)
            losses.append(loss)
            norms.append(norm)
        return (np.array([runtime.to_host(x) for x in losses], np.float32),
                np.array([runtime.to_host(x) for x in norms], np.float32))

    del steps_per_loop
    host_loop.experimental_get_tracing_count = step.experimental_get_tracing_count
    host_loop.step, host_loop.positions = step, positions  # (benchmarks time the parts)
    return host_loop


def eval_forward(forward, model_inputs, tables):
    """(forward, model_inputs) of the eval step of a model with tables: the batch carries the
    partial lookups (`eval_to_device`), and the forward pass runs in their lookup scope."""
    names = [t.name for t in tables.tables]

    def inputs(batch):
        return model_inputs(batch), {n: batch[f"__table__/{n}"] for n in names}

    def run(pair):
        features, partials = pair
        with lookup_scope(tables.scope(partials)):
            return forward(features)

    return run, inputs


def eval_to_device(tables, placement, feature_axes):
    """host batch -> the eval step's DTensors: the batch's features and the tables' partial lookups."""

    def to_device(host_batch):
        out = placement.to_global(host_batch, feature_axes)
        out.update({f"__table__/{n}": p for n, p in tables.lookup(host_batch).items()})
        return out

    return to_device
