"""Sparse updates of embedding tables: a table's gradient as rows, and the update of only those rows.

A table's gradient is `Rows`: the ids a step looked up and one gradient row per id
(`ids` [n] with -1 for padding, `values` [n, width]), never a dense [rows, width]
tensor. `dedupe` sums the rows of repeated ids (inside the compiled step, with ops
DTensor can lay out: a sort, a cumulative sum and a segment sum, O(n log n) in the ids);
`sparse_apply` then updates the touched rows of one table shard and its optimizer slots
in place with TensorFlow's own sparse kernels (ResourceSparseApplyKerasMomentum,
ResourceScatterAdd; Adagrad and lazy Adam by gathers and scatter-updates), on the device
that holds the shard, outside the DTensor program (tfpod.embedding.tables runs it on
every local device's shard).

The arithmetic is tf_keras's own sparse update (legacy SGD, momentum SGD and Adagrad,
after tf_keras's de-duplication of repeated ids); Adam is lazy (the moments of rows a
step does not touch keep their values, as tensorflow-addons' LazyAdam and TorchRec's
fused sparse Adam), where tf_keras's Adam decays every row's moments every step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

from tfpod import UserError, compat

KINDS = ("sgd", "momentum", "adagrad", "adam")
# The id of rows `dedupe` leaves empty (after the last distinct id), and of padding ids while
# sorting: above every real row, so no shard owns it.
EMPTY = tf.int32.max


@dataclasses.dataclass(frozen=True)
class Rows:
    """A table's gradient as rows: `values[i]` is the gradient of row `ids[i]`.

    Attributes:
      ids: int32 [n]; -1 contributes nothing.
      values: [n, width].
    """

    ids: tf.Tensor
    values: tf.Tensor

    @property
    def dtype(self) -> tf.DType:
        return self.values.dtype

    def __mul__(self, scale: tf.Tensor) -> "Rows":
        """The rows scaled as a gradient is (`optimizers.Update.scaled`'s clipping)."""
        return Rows(self.ids, self.values * scale)

    def __tf_flatten__(self):  # a tf.nest structure of its two tensors (Update.scaled maps over it)
        return None, (self.ids, self.values)

    @classmethod
    def __tf_unflatten__(cls, metadata, components) -> "Rows":
        del metadata
        return cls(*components)


@dataclasses.dataclass(frozen=True)
class SparseRule:
    """How a table's rows are updated: the optimizer kind and its constant hyperparameters.

    Attributes:
      kind: sgd, momentum (tf_keras SGD with momentum), adagrad, adam (lazy).
      momentum, nesterov: momentum SGD.
      epsilon: Adagrad's and Adam's.
      beta_1, beta_2: Adam's.
      weight_decay: Adam's decoupled weight decay on the touched rows (0: none).
      slots: the optimizer's slot names this kind updates, in kernel order.
    """

    kind: str
    momentum: float = 0.0
    nesterov: bool = False
    epsilon: float = 1e-7
    beta_1: float = 0.9
    beta_2: float = 0.999
    weight_decay: float = 0.0
    slots: tuple = ()


def rule_for(optimizer, variable) -> SparseRule:
    """The sparse update matching a legacy tf_keras (or Model Garden) optimizer's dense one for
    `variable` (a table).

    Raises:
      UserError: an optimizer with no sparse update here (LAMB, LARS, RMSprop, AMSGrad...).
    """
    keras = compat.tf_keras()
    legacy = keras.optimizers.legacy
    config = optimizer.get_config()
    name = type(optimizer).__name__
    if isinstance(optimizer, legacy.SGD):
        if config.get("momentum"):
            return SparseRule("momentum", momentum=float(config["momentum"]), nesterov=bool(config.get("nesterov")),
                              slots=("momentum",))
        return SparseRule("sgd")
    if isinstance(optimizer, legacy.Adagrad):
        return SparseRule("adagrad", epsilon=float(config["epsilon"]), slots=("accumulator",))
    if isinstance(optimizer, legacy.Adam) and not config.get("amsgrad"):
        decay = 0.0
        if "weight_decay_rate" in config and compat.uses_weight_decay(optimizer, variable.name):
            decay = float(config["weight_decay_rate"])
        return SparseRule("adam", epsilon=float(config["epsilon"]), beta_1=float(config["beta_1"]),
                          beta_2=float(config["beta_2"]), weight_decay=decay, slots=("m", "v"))
    raise UserError(f"embedding table {variable.name}: optimizer {name} has no sparse update in tfpod; use sgd "
                    "(with or without momentum), adagrad or adamw (lazy Adam on the tables)")


def dedupe(rows: Rows) -> Rows:
    """`rows` with repeated ids summed: each distinct id once, in increasing order, then
    empty entries (id EMPTY, values 0) up to the input's length.

    Built from ops DTensor lays out (argsort's top-k, gathers, a cumulative sum, segment
    sums), so it runs inside the compiled step on replicated tensors; O(n log n) in the ids.

    Args:
      rows: ids [n] (negative: padding) and values [n, width], n static.
    """
    ids = tf.reshape(rows.ids, [-1])
    n = ids.shape[0]
    if n == 0:
        return Rows(ids, rows.values)
    keys = tf.where(ids < 0, tf.constant(EMPTY, ids.dtype), ids)
    keys = tf.cast(keys, tf.int32)
    order = tf.argsort(keys, stable=True)  # [n]
    sorted_keys = tf.gather(keys, order)
    values = tf.gather(rows.values, order)  # [n, width]
    values = values * tf.cast(sorted_keys != EMPTY, values.dtype)[:, None]  # padding ids' rows count nothing
    first = tf.concat([tf.ones([1], tf.int32), tf.cast(sorted_keys[1:] != sorted_keys[:-1], tf.int32)], 0)  # [n]
    segment = tf.cumsum(first) - 1  # [n]: the distinct id's index
    summed = tf.math.unsorted_segment_sum(values, segment, n)  # [n, width]
    distinct = tf.math.unsorted_segment_sum(sorted_keys * first, segment, n)  # each segment's one first key
    used = tf.math.unsorted_segment_sum(first, segment, n) > 0
    return Rows(tf.where(used, distinct, EMPTY), summed)


def squared_norm(rows: Rows) -> tf.Tensor:
    """The squared norm of a table's (de-duplicated) gradient: that of its dense [rows, width] form."""
    return tf.reduce_sum(tf.square(tf.cast(rows.values, tf.float32)))


def sparse_apply(rule: SparseRule, table, slots: Sequence, ids: tf.Tensor, grads: tf.Tensor, lr: tf.Tensor,
                 step: tf.Tensor):
    """Updates rows `ids` of one table shard and its slots in place (an ordinary TensorFlow
    op on the shard's device, not a DTensor one).

    Args:
      rule: the optimizer kind and hyperparameters (`rule_for`).
      table: the shard's resource handle (or a tf.Variable).
      slots: the slots' handles, in `rule.slots` order.
      ids: int [m] distinct local row indices of the shard (`dedupe` made them distinct).
      grads: [m, width] their gradients (clipped).
      lr: the learning rate at this step (scalar).
      step: the step counted from 1 (Adam's bias correction), scalar float.

    Returns:
      The update op (in a tf.function; None eagerly).
    """
    handle = getattr(table, "handle", table)
    slot_handles = [getattr(s, "handle", s) for s in slots]
    dtype = grads.dtype
    lr = tf.cast(lr, dtype)
    if rule.kind == "sgd":
        return tf.raw_ops.ResourceScatterAdd(resource=handle, indices=ids, updates=-grads * lr)
    if rule.kind == "momentum":
        return tf.raw_ops.ResourceSparseApplyKerasMomentum(
            var=handle, accum=slot_handles[0], lr=lr, grad=grads, indices=ids,
            momentum=tf.constant(rule.momentum, dtype), use_nesterov=rule.nesterov)
    if rule.kind == "adagrad":
        return _adagrad(handle, slot_handles[0], ids, grads, lr, tf.constant(rule.epsilon, dtype))
    if rule.kind == "adam":
        return _lazy_adam(rule, handle, slot_handles, ids, grads, lr, tf.cast(step, dtype))
    raise ValueError(f"unknown sparse update kind {rule.kind!r}")


def _adagrad(handle, accum, ids, grads, lr, epsilon):
    """ResourceSparseApplyAdagradV2's arithmetic (a += g^2; w -= lr g / (sqrt(a) + eps)),
    bit for bit, as whole-batch gathers and scatter-updates: the kernel loops over the rows
    one at a time (~0.4 us a row on CPU, a quarter of a DLRM step's update at batch 512)."""
    gather = lambda h: tf.raw_ops.ResourceGather(resource=h, indices=ids, dtype=grads.dtype)
    a = gather(accum) + grads * grads
    w = gather(handle) - lr * grads / (tf.sqrt(a) + epsilon)
    return tf.group(tf.raw_ops.ResourceScatterUpdate(resource=accum, indices=ids, updates=a),
                    tf.raw_ops.ResourceScatterUpdate(resource=handle, indices=ids, updates=w))


def _lazy_adam(rule: SparseRule, handle, slots, ids, grads, lr, step):
    """Adam on the touched rows only (ResourceApplyAdam's arithmetic per row):
    m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps),
    after Model Garden's decoupled decay w -= lr w decay when the table decays."""
    dtype = grads.dtype
    m_handle, v_handle = slots
    gather = lambda h: tf.raw_ops.ResourceGather(resource=h, indices=ids, dtype=dtype)
    b1, b2 = tf.constant(rule.beta_1, dtype), tf.constant(rule.beta_2, dtype)
    m = gather(m_handle) + (grads - gather(m_handle)) * (1.0 - b1)
    v = gather(v_handle) + (tf.square(grads) - gather(v_handle)) * (1.0 - b2)
    w = gather(handle)
    if rule.weight_decay:
        w = w - lr * w * tf.constant(rule.weight_decay, dtype)
    alpha = lr * tf.sqrt(1.0 - tf.pow(b2, step)) / (1.0 - tf.pow(b1, step))
    w = w - (m * alpha) / (tf.sqrt(v) + tf.constant(rule.epsilon, dtype))
    return tf.group(tf.raw_ops.ResourceScatterUpdate(resource=m_handle, indices=ids, updates=m),
                    tf.raw_ops.ResourceScatterUpdate(resource=v_handle, indices=ids, updates=v),
                    tf.raw_ops.ResourceScatterUpdate(resource=handle, indices=ids, updates=w))
