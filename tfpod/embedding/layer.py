"""The embedding layer: a table looked up by ids, optionally pooled (an EmbeddingBag).

`Embedding(rows, width, combiner)` holds its table as the weight `embeddings`
[rows, width]. Called on ids it returns, per example, the rows of its ids:
  combiner None    ids [batch, hot] -> [batch, hot, width] (a Keras Embedding; ids [batch] -> [batch, width])
  combiner "sum"   ids [batch, hot] -> [batch, width], the rows summed
  combiner "mean"  ids [batch, hot] -> [batch, width], the rows averaged over the example's real ids
Ids are padded with -1 (a negative id is no id: zero rows, not counted by the mean), or
a tf.RaggedTensor (padded with -1 here).

Two ways to run the same function:
- plainly (one device, a served model, a replicated table): a gather of the table;
- sharded (tfpod.embedding.tables): the table's shards were looked up before the step,
  on the devices that hold them, and the step's `lookup_scope` hands this layer those
  partial results ([row shards, batch, ...]); the layer sums them over the row shards, and
  its table's gradient is rows (tf.IndexedSlices: the ids, the gradient of each looked-up
  row, -1 ids for padding) for the sparse update, never a gather of the table in the step.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Mapping

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tfpod import UserError, compat, partitioning

COMBINERS = (None, "sum", "mean")
_ACTIVE = threading.local()


class LookupScope:
    """What a sharded step's trace gives its embedding layers, and what they give back.

    Attributes:
      partials: {id(layer): DTensor of the layer's partial lookups [row shards, batch, ...]}.
      output_layouts: {id(layer): the layout of the layer's output (batch split as the batch)}.
      table_layers: {id of a table's DVariable: id of its layer} (Tables.scope sets it).
      markers: {id(layer): a scalar DVariable on the step's mesh} for tables on other meshes
        (tfpod.embedding.whole): the layer reads it in place of its table, and the table's
        gradient rows are the marker's.
    """

    def __init__(self, partials: Mapping[int, tf.Tensor], output_layouts: Mapping[int, dtensor.Layout]):
        self.partials = dict(partials)
        self.output_layouts = dict(output_layouts)
        self.table_layers: dict[int, int] = {}
        self.markers: dict[int, object] = {}


def active_scope() -> LookupScope | None:
    """The lookup scope of the step being traced, or None."""
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def lookup_scope(scope: LookupScope):
    """Within: embedding layers with partial lookups in `scope` use them (inside a step's trace)."""
    stack = getattr(_ACTIVE, "stack", None)
    if stack is None:
        stack = _ACTIVE.stack = []
    stack.append(scope)
    try:
        yield scope
    finally:
        stack.pop()


def padded_ids(ids) -> tf.Tensor:
    """Ids as a dense int tensor, -1 where a RaggedTensor (or SparseTensor) has none."""
    if isinstance(ids, tf.RaggedTensor):
        return ids.to_tensor(default_value=-1)
    if isinstance(ids, tf.SparseTensor):
        return tf.sparse.to_dense(ids, default_value=-1)
    ids = tf.convert_to_tensor(ids)
    if not ids.dtype.is_integer:
        ids = tf.cast(ids, tf.int32)
    return ids


def pool(rows: tf.Tensor, valid: tf.Tensor, combiner: str | None) -> tf.Tensor:
    """rows [batch, hot, width] with padding rows already zero -> [batch, width] (sum/mean) or as is."""
    if combiner is None:
        return rows
    total = tf.reduce_sum(rows, axis=1)
    if combiner == "sum":
        return total
    count = tf.reduce_sum(tf.cast(valid, rows.dtype), axis=1, keepdims=True)  # [batch, 1]
    return total / tf.maximum(count, 1.0)


def lookup(table, ids, combiner: str | None = None) -> tf.Tensor:
    """The plain lookup: rows of `table` [rows, width] for `ids` (padded -1 or ragged), pooled.

    The same function as `tf.gather` (combiner None) or an EmbeddingBag (sum, mean).
    """
    ids = padded_ids(ids)
    valid = ids >= 0
    rows = tf.gather(table, tf.where(valid, ids, tf.zeros_like(ids)))  # [..., width]
    rows = rows * tf.cast(valid, rows.dtype)[..., None]
    if combiner is None or ids.shape.rank == 1:
        return rows
    return pool(rows, valid, combiner)


class TableLayer:
    """What tfpod.embedding.tables needs of a table's layer (a mixin): `embeddings` [rows, width],
    `combiner` (None, "sum", "mean") and `source` (the batch feature holding its ids). tfpod's
    Embedding has them; tfpod.keras gives a tf_keras Embedding whose rows are split them."""

    combiner: str | None = None
    source: str | None = None


def from_partials(layer: TableLayer, ids, scope: LookupScope) -> tf.Tensor:
    """A table layer's output from the shards' partial lookups, its gradient rows.

    partials [row shards, batch, width] (pooled: a combiner, or one id per example) or
    [row shards, batch, hot, width] (combiner None): summed over the row shards (a
    reduction over the table's row axis), then split as the batch. The table's gradient is
    tf.IndexedSlices: the ids (-1: padding) and each looked-up row's gradient, the output's
    (divided by the example's id count for "mean"), never a dense [rows, width] tensor.
    """
    ids = padded_ids(ids)
    partials = scope.partials[id(layer)]
    layout = scope.output_layouts[id(layer)]
    pooled = partials.shape.rank == 3
    if ids.shape.rank == 1:
        ids = ids[:, None]  # [batch, 1]
    valid = ids >= 0  # [batch, hot]
    count = tf.maximum(tf.reduce_sum(tf.cast(valid, tf.float32), axis=1), 1.0)  # [batch]
    mean = pooled and layer.combiner == "mean"
    shape = compat.inner_variable(layer.embeddings).shape.as_list()
    table = scope.markers.get(id(layer))  # a table on another mesh: its marker is read instead
    if table is None:
        table = compat.inner_variable(layer.embeddings)  # (under mixed precision: not a cast of the whole table)

    @tf.custom_gradient
    def output(x):
        # Marks the table as read here, so that its gradient is `grad`'s rows. The read
        # shares the shards' buffers (Tables.apply turns the copy-on-read of sparse
        # updates off), and nothing uses its value.
        table.value()
        y = dtensor.relayout(tf.reduce_sum(x, axis=0), layout)  # [batch, (hot,) width]
        if mean:
            y = y / count[:, None]

        def grad(dy, variables=None):
            mask = tf.cast(valid, dy.dtype)  # [batch, hot]
            if pooled:
                if mean:
                    mask = mask / count[:, None]
                values = dy[:, None, :] * mask[..., None]  # [batch, hot, width]
            else:
                values = dy * mask[..., None]
            rows = tf.IndexedSlices(tf.reshape(values, [-1, shape[1]]), tf.reshape(tf.cast(ids, tf.int32), [-1]),
                                    tf.constant(shape))
            return None, [rows] * len(variables or [])

        return y, grad

    if partitioning.active_context() is None:
        return output(partials)
    # The table's reads here (the mark, and custom_gradient's own read of the variables
    # its function read, through which the rows flow back) are never gathered: the `2d`
    # preset gathers weights where layers read them, and a gathered read's gradient
    # would be the dense table.
    with partitioning.gathered_weights(False):
        return output(partials)


class Embedding(TableLayer, tf_keras.layers.Layer):
    """An embedding table, looked up plainly or as shards on the devices that hold them.

    Args:
      rows: rows of the table (ids are in [0, rows); pad them to what the mesh's row
        split divides: tfpod refuses a table whose rows do not divide).
      width: the row width.
      combiner: None (one row per id), "sum" or "mean" (pooled over each example's ids).
      initializer: the table's initializer (default uniform +-sqrt(1/rows), as MLPerf's DLRM).
      source: the batch feature holding this table's ids (the sharded lookup reads it
        from the host batch before the step); None: set by whoever builds the model.
    """

    def __init__(self, rows: int, width: int, combiner: str | None = "sum", initializer=None,
                 source: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if rows < 1 or width < 1:
            raise UserError(f"embedding {self.name}: rows={rows} and width={width} must be positive")
        if combiner not in COMBINERS:
            raise UserError(f"embedding {self.name}: combiner={combiner!r} is not one of None, 'sum', 'mean'")
        self.rows, self.width, self.combiner, self.source = int(rows), int(width), combiner, source
        limit = (1.0 / rows) ** 0.5
        self.initializer = tf_keras.initializers.get(
            initializer or tf_keras.initializers.RandomUniform(-limit, limit))

    def build(self, input_shape):
        self.embeddings = self.add_weight("embeddings", shape=[self.rows, self.width], initializer=self.initializer,
                                          dtype=tf.float32)
        super().build(input_shape)

    def call(self, ids):
        scope = active_scope()
        if scope is not None and id(self) in scope.partials:
            return tf.cast(from_partials(self, ids, scope), self.compute_dtype)
        if partitioning.active_context() is not None and partitioning.rows_split(self.embeddings):
            raise UserError(f"embedding {self.name}: its table's rows are split over the mesh, and the step has none "
                            "of its shards' lookups: the model's task must declare `sparse_tables = True` "
                            "(tfpod.embedding.executor.TablesExecutor runs its steps)")
        return tf.cast(lookup(self.embeddings, ids, self.combiner), self.compute_dtype)

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if self.combiner is None or input_shape.rank == 1:
            return input_shape.concatenate([self.width])
        return input_shape[:1].concatenate([self.width])

    def get_config(self):
        config = super().get_config()
        config.update(rows=self.rows, width=self.width, combiner=self.combiner, source=self.source,
                      initializer=tf_keras.initializers.serialize(self.initializer))
        return config
