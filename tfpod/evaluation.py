"""Distributed on-device evaluation: metrics as sums, every example counted exactly once.

A metric is a pair of functions: `update(outputs, batch) -> {name: sum}` computes
per-batch sums (weighted loss, token and example counts, correct counts) inside the
compiled eval step, where the reduction over the batch is a reduction over the whole
mesh; `result(sums) -> {name: value}` turns the accumulated sums into numbers on the
host, which reads only those few scalars.

Exactness: each host pads its last batch with weight-0 rows, and a host with fewer
batches runs padding batches, so every host runs the same number of eval steps; the
hosts agree on that number with a collective before starting. Padding has weight 0, so
it adds nothing to any sum, and `num_examples` counts the real rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor


@dataclasses.dataclass(frozen=True)
class Metric:
    """update(outputs, batch) -> {sum name: scalar}; result(sums) -> {metric name: float}.

    A metric that is no sum over batches (exact AUC, tfpod.auc) also gives `gather`:
    (outputs, batch) -> {name: [batch] per-example values}, which each step returns and
    `evaluate` gathers replicated, to stay on the devices over the eval set, and `finish`:
    ({name: [examples]}, the whole set's per-example values) -> {sum name: scalar tensor},
    computed on device once at the end and passed to `result` with the sums.
    """

    name: str
    update: Callable[[tf.Tensor, Mapping[str, tf.Tensor]], dict]
    result: Callable[[Mapping[str, float]], dict]
    gather: Callable[[tf.Tensor, Mapping[str, tf.Tensor]], dict] | None = None
    finish: Callable[[Mapping[str, tf.Tensor]], dict] | None = None


def _row_weights(weights: tf.Tensor) -> tf.Tensor:
    """1 for rows with any weight (real examples), 0 for padding rows; [batch]."""
    return tf.cast(tf.reduce_max(tf.reshape(weights, [tf.shape(weights)[0], -1]), axis=1) > 0, tf.float32)


def lm_update(logits: tf.Tensor, batch: Mapping[str, tf.Tensor]) -> dict:
    """Causal-LM sums: weighted cross entropy, tokens, correct next tokens, examples."""
    weights = tf.cast(batch["weights"], tf.float32)  # [batch, length]
    vocab = logits.shape[-1]
    log_z = tf.reduce_logsumexp(logits, axis=-1)
    target_logit = tf.reduce_sum(logits * tf.one_hot(batch["targets"], vocab, dtype=logits.dtype), axis=-1)
    correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), batch["targets"]), tf.float32)
    return {
        "loss_sum": tf.reduce_sum((log_z - target_logit) * weights),
        "token_count": tf.reduce_sum(weights),
        "correct_tokens": tf.reduce_sum(correct * weights),
        "example_count": tf.reduce_sum(_row_weights(weights)),
    }


def lm_result(sums: Mapping[str, float]) -> dict:
    tokens = max(sums["token_count"], 1.0)
    loss = sums["loss_sum"] / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "token_accuracy": sums["correct_tokens"] / tokens}


LM = Metric("lm", lm_update, lm_result)


def masked_lm_update(logits: tf.Tensor, batch: Mapping[str, tf.Tensor]) -> dict:
    """Masked-LM sums over predicted positions: logits [batch, predictions, vocab]."""
    weights = tf.cast(batch["masked_lm_weights"], tf.float32)
    correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), batch["masked_lm_ids"]), tf.float32)
    return {
        "mlm_correct": tf.reduce_sum(correct * weights),
        "mlm_count": tf.reduce_sum(weights),
        "example_count": tf.reduce_sum(_row_weights(weights)),
    }


MASKED_LM = Metric("masked_lm", masked_lm_update,
                   lambda s: {"masked_lm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1.0)})


def classification_update(logits: tf.Tensor, batch: Mapping[str, tf.Tensor]) -> dict:
    """Top-1 and top-5 sums: logits [batch, classes], labels [batch], weights [batch]."""
    weights = tf.cast(batch["weights"], tf.float32)
    labels = tf.cast(batch["labels"], tf.int32)
    label_logit = tf.reduce_sum(logits * tf.one_hot(labels, logits.shape[-1], dtype=logits.dtype), axis=-1)
    # rank of the label = number of classes scoring strictly higher (no gather, no top_k)
    higher = tf.reduce_sum(tf.cast(logits > label_logit[:, None], tf.float32), axis=-1)
    return {
        "top1_correct": tf.reduce_sum(tf.cast(higher < 1, tf.float32) * weights),
        "top5_correct": tf.reduce_sum(tf.cast(higher < 5, tf.float32) * weights),
        "example_count": tf.reduce_sum(weights),
    }


CLASSIFICATION = Metric(
    "classification",
    classification_update,
    lambda s: {"top1_accuracy": s["top1_correct"] / max(s["example_count"], 1.0),
               "top5_accuracy": s["top5_correct"] / max(s["example_count"], 1.0)},
)


def pad_rows(batch: Mapping[str, np.ndarray], rows: int) -> dict:
    """A host batch padded to `rows` rows with zeros (weight 0: the padding counts nothing)."""
    n = next(iter(batch.values())).shape[0]
    if n == rows:
        return dict(batch)
    return {k: np.concatenate([v, np.zeros((rows - n,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}


def agree_max(value: int, mesh: dtensor.Mesh) -> int:
    """The maximum of a per-host integer over all hosts (a collective on the mesh)."""
    shape = [mesh.dim_size(n) for n in mesh.dim_names]
    layout = dtensor.Layout(list(mesh.dim_names), mesh)
    local = [tf.constant(value, tf.int64, shape=[1] * len(shape)) for _ in mesh.local_devices()]
    packed = dtensor.pack(local, layout)
    reduced = tf.reduce_max(packed)  # replicated scalar: the all-reduce across hosts
    return int(dtensor.unpack(reduced)[0].numpy())


def host_sum(values, mesh: dtensor.Mesh) -> np.ndarray:
    """The sum over all hosts of a per-host float vector (a collective on the mesh).

    Each host puts its vector on its first local device and zeros on the others, so
    the reduction over every mesh axis counts each host once. Every host must call it.
    """
    values = np.asarray(values, np.float64).reshape([-1])
    rank = len(mesh.dim_names)
    shape = [1] * rank + [values.size]
    layout = dtensor.Layout(list(mesh.dim_names) + [dtensor.UNSHARDED], mesh)
    local = [tf.constant(values if i == 0 else np.zeros_like(values), tf.float64, shape=shape)
             for i, _ in enumerate(mesh.local_devices())]
    reduced = tf.reduce_sum(dtensor.pack(local, layout), axis=list(range(rank)))  # [n], replicated
    return dtensor.unpack(reduced)[0].numpy()


def make_eval_step(forward: Callable[[Mapping], tuple], metric: Metric):
    """The compiled eval step: forward pass and the metric's sums, reduced over the mesh
    (and with a metric's `gather`, its per-example values as they lie on the mesh).

    Args:
      forward: packed batch -> (the model's outputs, training=False; the features the
        metric reads): the executor's eval forward (tfpod.executor.Executor.eval_forward).
      metric: the metric.
    """

    @tf.function(autograph=False)
    def eval_step(batch):
        outputs, features = forward(batch)
        sums = metric.update(tf.cast(outputs, tf.float32), features)
        sums = {k: tf.cast(v, tf.float64) for k, v in sums.items()}
        if metric.gather is None:
            return sums
        return sums, metric.gather(tf.cast(outputs, tf.float32), features)

    return eval_step


def run_padded(step: Callable[[dict], object], host_batches: Sequence[Mapping[str, np.ndarray]], host_rows: int,
               to_device: Callable[[dict], dict], mesh: dtensor.Mesh, padding: Mapping[str, np.ndarray] | None = None
               ) -> list:
    """`step(to_device(batch))` over this host's batches, every host the same number of calls.

    Each batch is padded to host_rows rows with zeros (weight 0); a host with fewer
    batches than another runs padding batches (`padding`, default zeros like its first
    batch), since the step's collectives need every host. The hosts agree on the count
    with a collective first.

    Returns:
      The outputs of every call, this host's real batches first (as many as it has).
    """
    batches = [pad_rows(b, host_rows) for b in host_batches]
    steps = agree_max(len(batches), mesh)
    if steps and padding is None:
        if not batches:
            raise ValueError("this host has no batches to pad from: pass `padding`")
        padding = {k: np.zeros_like(v) for k, v in batches[0].items()}
    return [step(to_device(batches[i] if i < len(batches) else padding)) for i in range(steps)]


_FINISHED = {}


def _replicated(value: tf.Tensor) -> tf.Tensor:
    """A step's (DTensor) output relaid out replicated on its own mesh (a pipeline's: the last stage's)."""
    if not dtensor.is_dtensor(value):
        return value
    mesh = dtensor.fetch_layout(value).mesh
    return dtensor.relayout(value, dtensor.Layout.replicated(mesh, value.shape.rank))


def _finish(metric: Metric):
    """metric.finish compiled once per metric (its inputs' length may differ between evals)."""
    if metric.name not in _FINISHED:
        _FINISHED[metric.name] = tf.function(lambda values: {k: tf.cast(v, tf.float64)
                                                             for k, v in metric.finish(values).items()},
                                             autograph=False, reduce_retracing=True)
    return _FINISHED[metric.name]


def evaluate(eval_step, host_batches: Iterable[Mapping[str, np.ndarray]], host_rows: int, to_device,
             mesh: dtensor.Mesh, metric: Metric) -> dict:
    """Runs the eval set once; returns the metric's results and the true num_examples.

    Args:
      eval_step: from make_eval_step.
      host_batches: this host's eval batches (the last may be short).
      host_rows: rows of a full host batch.
      to_device: host batch -> dict of global DTensors.
      mesh: the mesh (hosts agree on the step count over it).
      metric: the metric.
    """
    host_batches = list(host_batches)
    if not host_batches:
        raise ValueError("this host has no eval data")
    outputs = run_padded(eval_step, host_batches, host_rows, to_device, mesh)
    totals, examples = None, []
    for sums in outputs:  # sums over the whole mesh: a padding call on this host adds the others' real rows
        if metric.gather is not None:  # an all-gather: every device keeps the whole set's values
            sums, more = sums
            examples.append({k: _replicated(v) for k, v in more.items()})
        totals = sums if totals is None else {k: totals[k] + sums[k] for k in sums}
    if metric.gather is not None:  # the whole eval set's per-example values, on the devices
        totals.update(_finish(metric)({k: tf.concat([e[k] for e in examples], 0) for k in examples[0]}))
    host = {k: float(dtensor.unpack(v)[0].numpy()) if dtensor.is_dtensor(v) else float(v) for k, v in totals.items()}
    result = {k: float(v) for k, v in metric.result(host).items()}
    result["num_examples"] = int(round(host["example_count"]))
    result["eval_steps"] = len(outputs)
    return result
