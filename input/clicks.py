"""Click logs for recommenders: synthetic clicks from a known teacher, or the reference's Criteo files.

Batch contract (models/dlrm.py reads it):
  dense    float32 [rows, dense_features]
  cat_<t>  int32 [rows, multi_hot_sizes[t]]  ids in [0, table_sizes[t]), -1: no id
  labels   float32 [rows]  1 click, 0 none
  weights  float32 [rows]  1 (evaluation pads short batches with weight-0 rows)

`click_data.format='criteo'` reads the MLPerf reference's preprocessed Criteo 1TB
multi-hot files (tfpod.input.criteo). `format='synthetic'` (the default) generates
clicks whose labels are drawn from a known teacher model, so the best AUC any model can
reach on an eval set is known: the teacher's own AUC on it (reported by the DLRM task's
evaluation as `teacher_auc`). The teacher, for example features x (dense), ids of
table t (multi-hot), and its fixed random parameters:

    z = bias + w . x + sum_t s_t mean_h v_t[id % M] + gamma <sum_h a[id_(T-2)], sum_h b[id_(T-1)]>
    p(click) = sigmoid(z)

(v_t: a value per row, M = `teacher_rows` distinct rows per table; a and b vectors of
width 4 on the last two tables: a multiplicative interaction only cross layers
capture). Ids follow a power law (id = floor(rows * u^id_skew), u uniform), so some
rows repeat within and across batches. Generation is stateless TensorFlow: training
batch i of host h is a function of (seed, h, i) read from a counter, so the iterator is
checkpointable and a resumed run continues exactly; the eval set is a function of
`teacher_seed` alone, split evenly over the hosts (every example once).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import numpy as np
import tensorflow as tf

from tfpod import UserError, auc
from tfpod.input.common import DataConfig, ShardInfo, TaskInput

FORMATS = ("synthetic", "criteo")
EVAL_CHUNK = 4096  # eval examples generated per call (the eval set does not depend on the host count)
PAIR_WIDTH = 4


@dataclasses.dataclass(frozen=True)
class ClickDataConfig(DataConfig):
    """Click data. Attributes map 1:1 to gin `click_data.<name>`.

    Attributes:
      format: synthetic (clicks from a teacher model) or criteo (the MLPerf reference's
        preprocessed multi-hot files, tfpod.input.criteo).
      train_files: criteo: glob(s) of the reference's `day_<d>_dense.npy` files (its
        `day_<d>_labels.npy` and `day_<d>_sparse_multi_hot.npz` beside each); synthetic: unused.
      eval_files: criteo: the eval day's dense file (the reference: day 23).
      eval_split: criteo: which rows of the eval files: val (the first half, the
        reference's validation set), test (the second half) or all.
      teacher_seed: synthetic: the teacher's parameters and the eval set.
      eval_examples: synthetic: examples in the eval set.
      teacher_rows: synthetic: distinct teacher values per table (ids beyond share them).
      id_skew: synthetic: power of the id distribution (1: uniform; larger: more repeats).
      dense_weight, table_weight, pair_weight: synthetic: scales of the teacher's dense,
        per-table and interaction terms.
      bias: synthetic: the teacher's bias (sets the click rate).
    """

    gin_name: ClassVar[str] = "click_data"

    format: str = "synthetic"
    eval_split: str = "val"
    teacher_seed: int = 1234
    eval_examples: int = 16384
    teacher_rows: int = 4096
    id_skew: float = 2.0
    dense_weight: float = 0.3
    table_weight: float = 0.5
    pair_weight: float = 0.6
    bias: float = -1.0

    def __post_init__(self):
        super().__post_init__()
        if self.format not in FORMATS:
            raise UserError(f"click_data.format={self.format!r}: use one of {', '.join(FORMATS)}")
        if self.eval_split not in ("val", "test", "all"):
            raise UserError(f"click_data.eval_split={self.eval_split!r}: use val, test or all")
        if self.eval_examples < 1 or self.teacher_rows < 1 or self.id_skew <= 0:
            raise UserError("click_data.eval_examples and teacher_rows must be positive, id_skew > 0")


@dataclasses.dataclass(frozen=True)
class Teacher:
    """The teacher's parameters (numpy), a function of the data's teacher_seed and the model's shapes."""

    bias: float
    dense: np.ndarray  # [dense_features]
    values: tuple  # per table [teacher rows]
    scales: np.ndarray  # [tables]
    pair_a: np.ndarray  # [teacher rows, PAIR_WIDTH] on the last table but one
    pair_b: np.ndarray  # on the last table (the same table when there is one)
    pair_weight: float


@functools.lru_cache(maxsize=8)
def make_teacher(cfg: ClickDataConfig, table_sizes: tuple, dense_features: int) -> Teacher:
    rng = np.random.default_rng([cfg.teacher_seed, 0])
    rows = [min(n, cfg.teacher_rows) for n in table_sizes]
    return Teacher(
        bias=cfg.bias,
        dense=(rng.standard_normal(dense_features) * cfg.dense_weight).astype(np.float32),
        values=tuple(rng.standard_normal(r).astype(np.float32) for r in rows),
        scales=(np.full(len(rows), cfg.table_weight) * rng.uniform(0.5, 1.5, len(rows))).astype(np.float32),
        pair_a=(rng.standard_normal([rows[max(len(rows) - 2, 0)], PAIR_WIDTH]) * 0.7).astype(np.float32),
        pair_b=(rng.standard_normal([rows[-1], PAIR_WIDTH]) * 0.7).astype(np.float32),
        pair_weight=cfg.pair_weight,
    )


def _seed(stream: int, index, k: int) -> tf.Tensor:
    return tf.stack([tf.constant(stream * 1009 + k, tf.int64), tf.cast(index, tf.int64)])


def generate(cfg: ClickDataConfig, model_config, stream: int, index, rows: int) -> dict:
    """`rows` examples of batch `index` of a stream (TensorFlow ops; also the teacher's
    click probability, `probability` [rows])."""
    teacher = make_teacher(cfg, tuple(model_config.table_sizes), model_config.dense_features)
    dense = tf.random.stateless_normal([rows, model_config.dense_features], _seed(stream, index, 0))
    z = teacher.bias + tf.linalg.matvec(dense, tf.constant(teacher.dense))  # [rows]
    out = {"dense": dense}
    tables = len(model_config.table_sizes)
    first, last = f"cat_{max(tables - 2, 0)}", f"cat_{tables - 1}"
    for t, (size, hot) in enumerate(zip(model_config.table_sizes, model_config.multi_hot_sizes)):
        u = tf.random.stateless_uniform([rows, hot], _seed(stream, index, t + 1))
        ids = tf.minimum(tf.cast(tf.floor(size * tf.pow(u, cfg.id_skew)), tf.int32), size - 1)  # [rows, hot]
        out[f"cat_{t}"] = ids
        values = tf.constant(teacher.values[t])
        z += teacher.scales[t] * tf.reduce_mean(tf.gather(values, ids % values.shape[0]), axis=1)
    pooled = [tf.reduce_sum(tf.gather(tf.constant(p), out[f] % p.shape[0]), axis=1)  # [rows, PAIR_WIDTH]
              for p, f in ((teacher.pair_a, first), (teacher.pair_b, last))]
    z += teacher.pair_weight * tf.reduce_sum(pooled[0] * pooled[1], axis=1)
    probability = tf.sigmoid(z)
    draw = tf.random.stateless_uniform([rows], _seed(stream, index, 999))
    out["labels"] = tf.cast(draw < probability, tf.float32)
    out["weights"] = tf.ones([rows], tf.float32)
    out["probability"] = probability
    return out


def _eval_stream(cfg: ClickDataConfig) -> int:
    return 2 * cfg.teacher_seed + 1


def _train_stream(seed: int, host: int) -> int:
    return 2 * (seed * 4099 + host)


def eval_size(cfg: ClickDataConfig) -> int:
    return min(cfg.eval_examples, cfg.max_eval_examples or cfg.eval_examples)


def synthetic_input(cfg: ClickDataConfig, model_config, shard: ShardInfo, seed: int) -> TaskInput:
    """The synthetic clicks' TaskInput: this host's training stream and its share of the eval set."""
    drop = lambda b: {k: v for k, v in b.items() if k != "probability"}

    def train(host_rows: int) -> tf.data.Dataset:
        stream = _train_stream(seed, shard.index)
        ds = tf.data.Dataset.counter().map(lambda i: drop(generate(cfg, model_config, stream, i, host_rows)))
        return ds.prefetch(2)

    def evaluation(host_rows: int) -> tf.data.Dataset:
        n = eval_size(cfg)
        base, extra = divmod(n, shard.num_shards)
        start = shard.index * base + min(shard.index, extra)
        count = base + (1 if shard.index < extra else 0)
        chunks = -(-n // EVAL_CHUNK)
        ds = tf.data.Dataset.range(chunks).map(
            lambda i: drop(generate(cfg, model_config, _eval_stream(cfg), i, EVAL_CHUNK)))
        return ds.unbatch().skip(start).take(count).batch(host_rows)

    source = {f"click_data.{f.name}": getattr(cfg, f.name) for f in dataclasses.fields(cfg) if "eval" not in f.name}
    source.update(table_sizes=list(model_config.table_sizes), multi_hot_sizes=list(model_config.multi_hot_sizes),
                  dense_features=model_config.dense_features)
    return TaskInput(train=train, eval=evaluation, find_corrupt=lambda: None, source=source)


@functools.lru_cache(maxsize=4)
def _teacher_auc(cfg: ClickDataConfig, table_sizes: tuple, multi_hot_sizes: tuple, dense_features: int) -> float:
    shapes = _Shapes(table_sizes, multi_hot_sizes, dense_features)
    n = eval_size(cfg)
    parts = [generate(cfg, shapes, _eval_stream(cfg), i, EVAL_CHUNK) for i in range(-(-n // EVAL_CHUNK))]
    probability = tf.concat([p["probability"] for p in parts], 0)[:n]
    labels = tf.concat([p["labels"] for p in parts], 0)[:n]
    return float(auc.exact_auc(probability, auc.signed_weights(labels, tf.ones_like(labels))).numpy())


@dataclasses.dataclass(frozen=True)
class _Shapes:
    table_sizes: tuple
    multi_hot_sizes: tuple
    dense_features: int


def teacher_auc(cfg, model_config) -> float | None:
    """The teacher's exact AUC on the synthetic eval set (every host's share): the best a
    model can reach on it. None for other data."""
    if not isinstance(cfg, ClickDataConfig) or cfg.format != "synthetic":
        return None
    with tf.device("/device:CPU:0"):
        return _teacher_auc(cfg, tuple(model_config.table_sizes), tuple(model_config.multi_hot_sizes),
                            model_config.dense_features)


def synthetic_batch(model_config, rows: int, rng: np.random.Generator) -> dict:
    """A batch of synthetic clicks (train.synthetic_data=True): the default teacher, seeded by `rng`."""
    with tf.device("/device:CPU:0"):
        batch = generate(ClickDataConfig(), model_config, int(rng.integers(1 << 30)), 0, rows)
    return {k: v.numpy() for k, v in batch.items() if k != "probability"}


def click_input(cfg: ClickDataConfig, model_config, shard: ShardInfo, seed: int) -> TaskInput:
    """The click model's TaskInput for either format."""
    if cfg.format == "criteo":
        from tfpod.input import criteo

        if not cfg.train_files:
            raise UserError("click_data.format='criteo' needs click_data.train_files: the glob of the reference's "
                            "day_<d>_dense.npy files")
        return criteo.criteo_input(cfg, model_config, shard, seed)
    return synthetic_input(cfg, model_config, shard, seed)
