"""Keras `fit` with embedding tables: a Keras Embedding whose rows are split trains as a tfpod.embedding table.

At compile (tfpod.keras.hooks), `attach` finds the model's table layers (a tf_keras
Embedding under a row rule becomes tfpod.keras.layers.TableEmbedding) and the model
input each reads its ids from, and checks the optimizer (a legacy tf_keras SGD, Adagrad
or Adam: their sparse updates are tfpod.embedding.sparse's, and no clipnorm / global_clipnorm,
which fit would apply to the dense weights alone; otherwise the tables train by the one-hot
matmul with dense gradients, with one warning saying why). `fit` then runs each step as
tfpod's trainer does (tfpod.embedding.executor):

  1. the batch's ids, gathered replicated (every device holds the global batch's), and
     each device's partial lookups from its own rows (Tables.lookup_ids);
  2. the compiled step: Keras's own `train_step` in the lookup scope; when it applies
     the gradients (the optimizer hook, `take_rows`), the tables' gradient rows are
     taken out, gathered, de-duplicated and returned, and the optimizer applies the rest;
  3. every device updates its rows and slots in place (Tables.apply).

evaluate and predict look up the same way (one step per call), without the update.
"""

from __future__ import annotations

import logging
import types
import weakref

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tfpod import UserError, compat, embedding
from tfpod.embedding import layer as layer_lib, sparse

log = logging.getLogger("tfpod")
_TABLES = weakref.WeakKeyDictionary()  # model -> its Tables and where each table's ids come from


def attach(model, optimizer, layout_map) -> None:
    """Sets up the sparse path of a compiled model's tables (none: nothing to do). A model
    this path cannot train (another optimizer, clipping, ids that are no model input) trains
    its tables as before, by the one-hot matmul with dense gradients, with one warning."""
    layers = embedding.find_layers(model)
    _TABLES.pop(model, None)
    if not layers:
        return
    why = None
    if not isinstance(optimizer, compat.legacy_optimizer_class()):
        why = "its optimizer is not a legacy tf_keras SGD, Adagrad or Adam (tf_keras.optimizers.legacy)"
    elif getattr(optimizer, "clipnorm", None) or getattr(optimizer, "global_clipnorm", None):
        why = "its optimizer clips (clipnorm / global_clipnorm would clip the dense weights alone)"
    elif not compat.is_functional(model):
        why = "it is not a functional model (each table's ids one of its inputs)"
    sources = {}
    for layer in layers if why is None else ():
        try:
            feeding = layer.input
        except (AttributeError, ValueError, RuntimeError):
            feeding = None
        found = [i for i, x in enumerate(model.inputs) if x is feeding]
        if not found:
            why = f"the ids of {layer.name!r} are not one of its inputs"
            break
        layer.source = model.input_names[found[0]]
        sources[layer.name] = found[0]
    if why is None:
        try:
            embedding.sparse.rule_for(optimizer, layers[0].embeddings)
        except UserError as e:
            why = str(e)
    if why is not None:
        log.warning("model %s: its embedding tables split by rows (%s) train with one-hot lookups and dense "
                    "updates, not sparse ones: %s", model.name, ", ".join(l.name for l in layers), why)
        return
    placement = types.SimpleNamespace(mesh=layout_map.mesh, table=layout_map.table)
    axes = {name: ("batch",) + (None,) * (x.shape.rank - 1) for name, x in zip(model.input_names, model.inputs)}
    tables = embedding.Tables(model, placement, axes, optimizer)
    _TABLES[model] = (tables, sources)
    log.info("model %s: %d embedding table(s) split by rows train with sparse lookups and updates", model.name,
             len(layers))


def has_tables(model) -> bool:
    return model in _TABLES


def _ids(x, index: int, names):
    if isinstance(x, dict):
        return x[names[index]]
    if isinstance(x, (list, tuple)):
        return x[index]
    return x


def make_function(model, kind: str):
    """fit's train function (kind "train"), or evaluate's ("test") or predict's ("predict"),
    for a model with tables: each step a lookup, Keras's own step compiled on the mesh in
    the lookup scope, and in training the tables' update (module docstring). Training runs
    steps_per_execution steps per call, evaluate and predict one (as tfpod.keras.hooks)."""
    tables, sources = _TABLES[model]
    names = model.input_names
    steps = int(compat.steps_per_execution(model).numpy()) if kind == "train" else 1
    spread = {}

    def replicated(values):
        key = tuple(v.shape.rank for v in values)
        if key not in spread:
            mesh = tables.mesh
            spread[key] = tf.function(lambda vs: [dtensor.relayout(v, dtensor.Layout.replicated(mesh, v.shape.rank))
                                                  for v in vs])
        return [dtensor.unpack(v)[0] for v in spread[key](list(values))]

    keras_step = {"train": model.train_step, "test": model.test_step, "predict": model.predict_step}[kind]

    @tf.function
    def step(data, partials):
        scope = tables.scope(partials)
        scope.sparse_rows = [] if kind == "train" else None
        with layer_lib.lookup_scope(scope):
            out = keras_step(data)
        return (out, *scope.sparse_rows) if kind == "train" else out

    def function(iterator):
        out = None
        for _ in range(steps):
            data = iterator.get_next()
            x, _, _ = tf_keras.utils.unpack_x_y_sample_weight(data)
            ids = replicated([_ids(x, sources[t.name], names) for t in tables.tables])
            partials = tables.lookup_ids(tables.shaped_ids(ids))
            if kind != "train":
                return step(data, partials)
            out, rows, hyper = step(data, partials)
            tables.apply(rows, hyper)
        return out

    return function


def take_rows(optimizer, grads_and_vars) -> list:
    """Inside a table model's compiled step: takes the tables' gradient rows out of the
    optimizer's (gradient, variable) pairs, de-duplicated and gathered replicated, into the
    step's lookup scope with [lr, finite, step]; returns the other pairs."""
    scope = layer_lib.active_scope()
    if scope is None or getattr(scope, "sparse_rows", None) is None or not scope.table_layers:
        return grads_and_vars
    pairs = list(grads_and_vars)
    mesh = next(iter(scope.output_layouts.values())).mesh
    replicated = lambda t: dtensor.relayout(t, dtensor.Layout.replicated(mesh, t.shape.rank))
    by_var = {id(compat.inner_variable(v)): g for g, v in pairs if id(compat.inner_variable(v)) in scope.table_layers}
    rows, squares = [], []
    for var_id in scope.table_layers:  # (in Tables' order)
        g = by_var.get(var_id)
        if g is None:
            raise UserError("an embedding table got no gradient in a step of fit: every table must be used by the loss")
        deduped = sparse.dedupe(sparse.Rows(replicated(tf.cast(g.indices, tf.int32)), replicated(g.values)))
        rows.append((deduped.ids, deduped.values))
        squares.append(sparse.squared_norm(deduped))
    finite = tf.math.is_finite(tf.add_n(squares))
    lr = tf.cast(compat.decayed_lr(optimizer), tf.float32)
    step = tf.cast(optimizer.iterations + 1, tf.float32)
    # (read before the optimizer's update advances its counter: ops on one variable run in program order)
    scope.sparse_rows = (rows, tf.stack([lr, tf.cast(finite, tf.float32), step]))
    return [(g, v) for g, v in pairs if id(compat.inner_variable(v)) not in scope.table_layers]
