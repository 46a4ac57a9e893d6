"""DLRM-DCNv2, MLPerf Training's recommender (click-through prediction on Criteo 1TB multi-hot).

The model of mlcommons/training recommendation_v2/torchrec_dlrm (TorchRec's `DLRM_DCN`):

    dense [batch, 13] -> bottom MLP (ReLU on every layer)             -> [batch, D]
    cat_t [batch, hot_t] -> embedding table t, ids summed (EmbeddingBag) -> [batch, D]   (26 tables)
    x0 = concat(bottom, tables) [batch, 27 D]
    x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l    l < cross_layers    (DCN-v2 low-rank cross, rank r)
    top MLP (ReLU, the last layer linear) -> the click logit [batch]
    loss: binary cross-entropy on the logits

The tables are tfpod.embedding tables: under the `tensor` preset (the default) their rows
split over `model` (logical axis `vocab`), under `2d` also their columns over `data`
(`embed`); every device looks up and updates only its own rows (tfpod.embedding.tables);
MLPs and cross layers are data parallel (replicated), as in TorchRec. Table rows are
padded to a multiple of `row_multiple` (ids never reach the padding), so the splits of
every mesh the checkpoint moves between divide them.

Batch contract (tfpod.input.clicks produces it):
  dense    float32 [batch, dense_features]
  cat_<t>  int32 [batch, multi_hot_sizes[t]]  ids in [0, table_sizes[t]); -1: no id (padding)
  labels   float32 [batch]  1 click, 0 none
  weights  float32 [batch]  1 for real examples, 0 for padding
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from tfpod import UserError, auc, embedding
from tfpod.input import clicks
from tfpod.models import plan_profiles
from tfpod.partitioning import AxisRule
from tfpod.task import LossTerms, Task

# MLPerf Training DLRM-dcnv2 (mlcommons/training recommendation_v2/torchrec_dlrm, README.MD):
# the Criteo 1TB tables capped at 40M rows, and the multi-hot sizes of the materialized dataset.
MLPERF_TABLE_SIZES = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
                      11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
MLPERF_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
    """Shape of DLRM-DCNv2. Attributes map 1:1 to gin `dlrm.<name>`.

    Attributes:
      table_sizes: rows of each embedding table (one categorical feature each).
      multi_hot_sizes: ids per example of each feature (padded with -1 when fewer).
      embedding_dim: width of every table row, and of the bottom MLP's output.
      dense_features: continuous features per example.
      bottom_mlp: widths of the bottom MLP's layers (the last equals embedding_dim).
      top_mlp: widths of the top MLP's layers (the last is 1: the logit).
      cross_layers: DCN-v2 cross layers.
      cross_rank: their low rank (r: W_l is [r, 27 D], V_l [27 D, r]).
      combiner: how a feature's ids pool: sum (MLPerf's) or mean.
      row_multiple: each table's rows are padded to a multiple of this (so that any
        mesh axis dividing it splits every table; ids never reach the padding).
    """

    table_sizes: Sequence[int] = MLPERF_TABLE_SIZES
    multi_hot_sizes: Sequence[int] = MLPERF_MULTI_HOT
    embedding_dim: int = 128
    dense_features: int = 13
    bottom_mlp: Sequence[int] = (512, 256, 128)
    top_mlp: Sequence[int] = (1024, 1024, 512, 256, 1)
    cross_layers: int = 3
    cross_rank: int = 512
    combiner: str = "sum"
    row_multiple: int = 64

    def __post_init__(self):
        if len(self.table_sizes) != len(self.multi_hot_sizes) or not self.table_sizes:
            raise UserError(f"dlrm.table_sizes has {len(self.table_sizes)} tables but dlrm.multi_hot_sizes "
                            f"{len(self.multi_hot_sizes)}: give one multi-hot size per table")
        if min(self.table_sizes) < 1 or min(self.multi_hot_sizes) < 1:
            raise UserError("dlrm.table_sizes and dlrm.multi_hot_sizes must be positive")
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
            raise UserError(f"dlrm.bottom_mlp={tuple(self.bottom_mlp)} must end in dlrm.embedding_dim="
                            f"{self.embedding_dim} (its output sits beside the tables' rows)")
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise UserError(f"dlrm.top_mlp={tuple(self.top_mlp)} must end in 1 (the click logit)")
        if self.combiner not in ("sum", "mean"):
            raise UserError(f"dlrm.combiner={self.combiner!r}: use 'sum' or 'mean'")
        if self.row_multiple < 1 or self.cross_layers < 0 or self.cross_rank < 1:
            raise UserError("dlrm.row_multiple and dlrm.cross_rank must be positive, dlrm.cross_layers >= 0")

    @property
    def padded_rows(self) -> tuple:
        """Each table's rows padded to a multiple of row_multiple."""
        m = self.row_multiple
        return tuple(-(-n // m) * m for n in self.table_sizes)

    @property
    def interaction_width(self) -> int:
        """x0's width: the bottom MLP's output and every table's row, side by side."""
        return (len(self.table_sizes) + 1) * self.embedding_dim


def feature_name(table: int) -> str:
    return f"cat_{table}"


# Tables: rows over `vocab` (`model` under tensor and 2d), columns over `embed` (`data` under
# 2d); MLPs and cross layers replicated (data parallel, as TorchRec's).
AXIS_RULES = (
    AxisRule(r".*table_\d+/embeddings", ("vocab", "embed")),
    AxisRule(r".*(bottom|top)_\d+/kernel", (None, None)),
    AxisRule(r".*(bottom|top)_\d+/bias", (None,)),
    AxisRule(r".*cross_\d+_(down|up)/kernel", (None, None)),
    AxisRule(r".*cross_\d+_up/bias", (None,)),
)


def _torch_linear_init(fan_in: int):
    """PyTorch nn.Linear's default: uniform +-1/sqrt(fan_in) for weights and biases (TorchRec's MLPs)."""
    limit = 1.0 / np.sqrt(fan_in)
    return tf_keras.initializers.RandomUniform(-limit, limit)


class DLRM(tf_keras.Model):
    """{dense, cat_<t>} -> click logits [batch] (float32)."""

    def __init__(self, config: DLRMConfig, name: str = "dlrm"):
        super().__init__(name=name)
        self.config = config
        c = config
        widths = [c.dense_features] + list(c.bottom_mlp)
        self.bottom = [tf_keras.layers.Dense(w, activation="relu", kernel_initializer=_torch_linear_init(fan_in),
                                             bias_initializer=_torch_linear_init(fan_in), name=f"bottom_{i}")
                       for i, (fan_in, w) in enumerate(zip(widths, c.bottom_mlp))]
        self.tables = [embedding.Embedding(rows, c.embedding_dim, c.combiner, source=feature_name(t),
                                           initializer=tf_keras.initializers.RandomUniform(
                                               -(1.0 / n) ** 0.5, (1.0 / n) ** 0.5), name=f"table_{t}")
                       for t, (rows, n) in enumerate(zip(c.padded_rows, c.table_sizes))]
        d = c.interaction_width
        self.cross_down = [tf_keras.layers.Dense(c.cross_rank, use_bias=False, kernel_initializer="glorot_normal",
                                                 name=f"cross_{i}_down") for i in range(c.cross_layers)]
        self.cross_up = [tf_keras.layers.Dense(d, kernel_initializer="glorot_normal", bias_initializer="zeros",
                                               name=f"cross_{i}_up") for i in range(c.cross_layers)]
        widths = [d] + list(c.top_mlp)
        self.top = [tf_keras.layers.Dense(w, activation=None if i == len(c.top_mlp) - 1 else "relu",
                                          kernel_initializer=_torch_linear_init(fan_in),
                                          bias_initializer=_torch_linear_init(fan_in), name=f"top_{i}")
                    for i, (fan_in, w) in enumerate(zip(widths, c.top_mlp))]

    def call(self, inputs, training=None):
        x = tf.cast(inputs["dense"], tf.float32)  # [batch, dense_features]
        for layer in self.bottom:
            x = layer(x)  # [batch, embedding_dim] at the end
        pooled = [table(inputs[feature_name(t)]) for t, table in enumerate(self.tables)]  # each [batch, D]
        x0 = tf.concat([x] + pooled, axis=-1)  # [batch, (tables + 1) D]
        x = x0
        for down, up in zip(self.cross_down, self.cross_up):
            x = x0 * up(down(x)) + x  # DCN-v2 low-rank cross layer
        for layer in self.top:
            x = layer(x)
        return tf.cast(x[:, 0], tf.float32)  # [batch]


def input_signature(config: DLRMConfig) -> dict:
    sig = {"dense": tf.TensorSpec([None, config.dense_features], tf.float32, name="dense")}
    for t, hot in enumerate(config.multi_hot_sizes):
        sig[feature_name(t)] = tf.TensorSpec([None, hot], tf.int32, name=feature_name(t))
    return sig


class _FeatureAxes(dict):
    """The batch's logical axes; every `cat_<t>` feature (however many tables) is [batch, hot]."""

    def __missing__(self, key):
        if isinstance(key, str) and key.startswith("cat_") and key[4:].isdigit():
            return ("batch", None)
        raise KeyError(key)


def batch_axes() -> dict:
    return _FeatureAxes({"dense": ("batch", None), "labels": ("batch",), "weights": ("batch",),
                         "inputs": ("batch", None)})


def model_inputs(batch: dict) -> dict:
    """The features the model reads: dense and every cat_<t>."""
    return {k: v for k, v in batch.items() if k == "dense" or k.startswith("cat_")}


def loss_terms(model: DLRM, batch: dict, training: bool) -> LossTerms:
    """Binary cross-entropy on the click logits: [its sum over weighted examples]."""
    logits = model(model_inputs(batch), training=training)  # [batch]
    labels, weights = tf.cast(batch["labels"], tf.float32), tf.cast(batch["weights"], tf.float32)
    losses = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)  # [batch]
    loss_sum = tf.reduce_sum(losses * weights)
    return LossTerms([loss_sum], metrics={"loss_sum": loss_sum, "weight_sum": tf.reduce_sum(weights)})


def loss_counts(batch: dict) -> list:
    return [tf.reduce_sum(tf.cast(batch["weights"], tf.float32))]


def forward_macs(config: DLRMConfig) -> float:
    """Multiply-adds of one example's forward pass: the MLPs and the cross layers (the
    tables' lookups and sums are additions, left out)."""
    widths = [config.dense_features] + list(config.bottom_mlp)
    macs = sum(a * b for a, b in zip(widths, widths[1:]))
    widths = [config.interaction_width] + list(config.top_mlp)
    macs += sum(a * b for a, b in zip(widths, widths[1:]))
    macs += config.cross_layers * 2 * config.interaction_width * config.cross_rank
    return float(macs)


def flops_per_token(config: DLRMConfig) -> float:
    """Training FLOPs per example (token = example): 3 x the forward's 2 x multiply-adds."""
    return 6.0 * forward_macs(config)


def serving(model: DLRM, config: DLRMConfig, data_config) -> tuple[tf.Module, dict]:
    """The SavedModel signature on raw features (tables gathered into the single-device copy):
      serving_default(dense float32 [batch, dense_features], cat_<t> int32 [batch, hot_t],
        -1 for no id) -> probabilities float32 [batch], logits float32 [batch]
    Ids are reduced modulo the table's size, as the reference's preprocessing hashes them."""
    del data_config
    module = tf.Module()
    module.model = model
    specs = list(input_signature(config).values())  # dense, cat_0, ... (the signature's input names)

    @tf.function(input_signature=specs)
    def serving_default(*features):
        inputs = {"dense": features[0]}
        for t, size in enumerate(config.table_sizes):
            ids = features[t + 1]
            inputs[feature_name(t)] = tf.where(ids < 0, ids, ids % size)
        logits = model(inputs, training=False)
        return {"probabilities": tf.sigmoid(logits), "logits": logits}

    return module, {"serving_default": serving_default.get_concrete_function()}


def host_eval_metrics(context, host_batches) -> dict:
    """With synthetic clicks: the teacher's AUC on the same eval set (the best any model reaches)."""
    del host_batches
    best = clicks.teacher_auc(context.data_config, context.model_config)
    return {} if best is None else {"teacher_auc": best}


class DLRMTask(Task):
    """Click-through prediction with DLRM-DCNv2 (MLPerf's recommender): gin `dlrm.*`, data `click_data.*`."""

    name = "dlrm"
    config_class = DLRMConfig
    data_name = "click_data"
    data_config_class = clicks.ClickDataConfig
    default_preset = "tensor"
    axis_rules = AXIS_RULES
    eval_metric = auc.BINARY
    lower_is_better = frozenset({"loss"})
    build = staticmethod(DLRM)
    input_signature = staticmethod(input_signature)
    flops_per_token = staticmethod(flops_per_token)
    make_input = staticmethod(clicks.click_input)
    loss_terms = staticmethod(loss_terms)
    loss_counts = staticmethod(loss_counts)
    serving = staticmethod(serving)
    serves = True
    sparse_tables = True
    host_eval_metrics = staticmethod(host_eval_metrics)
    plan_profile = staticmethod(plan_profiles.dlrm)

    batch_axes = staticmethod(batch_axes)
    model_inputs = staticmethod(model_inputs)
    synthetic_batch = staticmethod(clicks.synthetic_batch)


TASK = DLRMTask()
