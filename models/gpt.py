"""Decoder-only causal Transformer LM built from tf-models-official layers.

Blocks are Model Garden's `TransformerEncoderBlock` in pre-norm (GPT-2) form with a causal
attention mask, rewritten as 2-D matmuls with the same weights and names (`Block`). The
token embedding is Model Garden's `OnDeviceEmbedding`: a one-hot matmul when its vocab rows
are split over devices (the sharded table then needs no gather or scatter), a plain gather
otherwise (the one-hot matmul costs 2 x vocab x embed FLOPs per token that count for
nothing). The output layer is tied to it (vocab-parallel logits under `tensor`) and is one 2-D
matmul over all tokens.

Batch contract (see tfpod.input.text for the pipeline that produces it):
  inputs       int32 [batch, length]  token ids fed to the model
  targets      int32 [batch, length]  next-token ids (inputs shifted by one)
  weights      float32 [batch, length]  1 for real target tokens, 0 for padding
  segment_ids  int32 [batch, length]  optional (segment packing): a token attends only
               to earlier tokens of its own segment; 0 is padding
  positions    int32 [batch, length]  optional: position of each token in its segment
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import tensorflow as tf
import tf_keras
from official.nlp.modeling import layers as mg_layers

from tfpod import UserError, attention, check_positive, compat, evaluation, fused
from tfpod.projection import Projection, leading_dims  # noqa: F401  (models use gpt.Projection)
from tfpod.input import lm_data
from tfpod.models import decoding, lm_head, lm_serving, plan_profiles
from tfpod.partitioning import AxisRule, context, rows_split, shard
from tfpod.task import LossTerms, StagedModel, Task

# The residual stream between blocks: its sequence dimension is the logical axis
# `sequence`, which only sequence parallelism maps to a mesh axis (`model`).
ACTIVATION_AXES = ("batch", "sequence", "embed")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the LM. Attributes map 1:1 to gin `gpt.<name>`.

    Attributes:
      vocab_size: rows of the token embedding, tied to the output layer; at least the
        vocabulary's pieces (pad it to a multiple of the model axis, e.g. 50257 -> 50304).
      seq_len: tokens per example; also the size of the learned position table.
      num_layers, embed_dim, num_heads, mlp_dim: the blocks, their width, attention heads
        (embed_dim / num_heads dimensions each) and MLP width.
      dropout, attention_dropout: on the embeddings and residual branches; on the attention
        probabilities.
      norm_epsilon: the layer norms' epsilon.
      init_stddev: truncated-normal initializer of every weight.
      activation: the MLP's activation: gelu (exact), gelu_approximate (tanh form, GPT-2's) or a Keras name.
      remat: recompute each block's activations in the backward pass instead of keeping
        them (less memory, about a third more compute); with dropout the recomputed block
        draws its forward pass's masks (tfpod.partitioning.replayable_dropout).
    """

    vocab_size: int = 8192
    seq_len: int = 128
    num_layers: int = 2
    embed_dim: int = 128
    num_heads: int = 8
    mlp_dim: int = 512
    dropout: float = 0.0
    attention_dropout: float = 0.0
    norm_epsilon: float = 1e-5
    init_stddev: float = 0.02
    activation: str = "gelu"
    remat: bool = False

    def __post_init__(self):
        check_positive(self, "gpt", ("vocab_size", "seq_len", "num_layers", "embed_dim", "num_heads", "mlp_dim"))
        if self.embed_dim % self.num_heads:
            raise UserError(
                f"gpt.embed_dim={self.embed_dim} is not divisible by gpt.num_heads={self.num_heads}: "
                "each head gets embed_dim / num_heads dimensions"
            )
        for field in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise UserError(f"gpt.{field}={getattr(self, field)} must be in [0, 1)")


# Variable names are "<model>/<layer>/.../<weight>"; one rule per kind of weight.
AXIS_RULES = (
    AxisRule(r".*/token_embedding/embeddings", ("vocab", "embed")),
    AxisRule(r".*/position_embedding/embeddings", (None, "embed")),
    AxisRule(r".*/self_attention/(query|key|value)/kernel", ("embed", "heads", "kv")),
    AxisRule(r".*/self_attention/(query|key|value)/bias", ("heads", "kv")),
    AxisRule(r".*/self_attention/attention_output/kernel", ("heads", "kv", "embed")),
    AxisRule(r".*/self_attention/attention_output/bias", ("embed",)),
    AxisRule(r".*/intermediate/kernel", ("embed", "mlp")),
    AxisRule(r".*/intermediate/bias", ("mlp",)),
    AxisRule(r".*/block_\d+/output/kernel", ("mlp", "embed")),
    AxisRule(r".*/block_\d+/output/bias", ("embed",)),
    AxisRule(r".*(layer_norm|final_norm)/(gamma|beta)", ("embed",)),
)


class DecoderLM(tf_keras.Model):
    """What GPT's task, its pipeline cut (`staged`), generation (models/decoding.py) and serving
    use of a decoder-only LM: GPT, MoELM (a subclass) and Llama implement it.

      blocks                          the transformer blocks, in order
      embed_inputs(features, training) -> x [batch, length, embed]
      block_and_aux(block, x, context, training) -> (x, the block's aux loss or None)
      final_hidden(x) -> the final norm's output
      output_table() -> the output layer's [vocab, embed] table
      stage_layers() -> (layers a pipeline's first stage holds besides its blocks, the last's)
      decode(ids, positions, caches) -> one step of cached generation
      kv_heads() -> the key/value heads its caches hold (the query heads unless overridden)

    `output_logits` (the output table's float32 logits) is shared.
    """

    def kv_heads(self) -> int:
        """The key/value heads each layer's generation cache holds: the query heads."""
        return self.config.num_heads

    def output_logits(self, x: tf.Tensor) -> tf.Tensor:
        """Float32 logits [batch, length, vocab] of x [batch, length, embed] (the output table's)."""
        table = tf.cast(self.output_table(), x.dtype)  # [vocab, embed]
        flat = context.flat_tokens(x, x.shape[-1])  # [batch * length, embed]
        logits = context.token_matmul(flat, table, transpose_b=True)  # [batch * length, vocab]
        logits = tf.reshape(logits, leading_dims(x, 2) + [self.config.vocab_size])
        return tf.cast(logits, tf.float32)


class GPT(DecoderLM):
    """Causal LM: token ids [batch, length] -> logits [batch, length, vocab]."""

    def __init__(self, config: GPTConfig, name: str = "gpt"):
        super().__init__(name=name)
        self.config = config
        def init():  # a fresh initializer per weight, so no two weights share values
            return tf_keras.initializers.TruncatedNormal(stddev=config.init_stddev)

        self.token_embedding = mg_layers.OnDeviceEmbedding(
            config.vocab_size,
            config.embed_dim,
            initializer=init(),
            use_one_hot=True,
            name="token_embedding",
        )
        self.position_embedding = mg_layers.PositionEmbedding(
            max_length=config.seq_len, initializer=init(), name="position_embedding"
        )
        self.embedding_dropout = tf_keras.layers.Dropout(config.dropout)
        self.blocks = [self.make_block(i, init) for i in range(config.num_layers)]
        self.final_norm = tf_keras.layers.LayerNormalization(
            epsilon=config.norm_epsilon, name="final_norm"
        )

    def make_block(self, i: int, init) -> tf_keras.layers.Layer:
        """Block i: a layer taking [x [batch, length, embed], mask [batch, length, length]]."""
        return Block(self.config, init, causal=True, name=f"block_{i}")

    def run_block(self, block, x, mask, training):
        """One block; with `remat` its activations are recomputed in the backward pass."""
        if not self.config.remat:
            return block([x, mask], training=training)
        if training and (self.config.dropout or self.config.attention_dropout):
            compat.check_replayable_dropout(block, "gpt.remat=True with dropout")
        return tf.recompute_grad(lambda x, mask: block([x, mask], training=training))(x, mask)

    def block_and_aux(self, block, x, mask, training):
        """One block as a pipeline stage runs it: (x, the block's own loss term: None)."""
        return self.run_block(block, x, mask, training), None

    def call(self, inputs, training=None, return_hidden=False):
        """Logits [batch, length, vocab] float32, or with `return_hidden` the final layer
        norm's output [batch, length, embed] that the tied output layer multiplies
        (`loss_terms` then computes the output layer and the loss together)."""
        features = inputs if isinstance(inputs, dict) else {"inputs": inputs}
        x = self.embed_inputs(features, training)
        mask = attention_mask(features["inputs"], features.get("segment_ids"))
        for block in self.blocks:
            x = self.run_block(block, x, mask, training)
            x = shard(x, ACTIVATION_AXES)
        x = self.final_hidden(x)
        return x if return_hidden else self.output_logits(x)

    def embed_inputs(self, features: dict, training) -> tf.Tensor:
        """The first block's input [batch, length, embed]: token and position embeddings, dropout."""
        ids = features["inputs"]
        x = self.embed(ids)  # [batch, length, embed]
        in_order = self.position_embedding(x)  # positions 0..length-1 (also builds the table)
        table = lambda: tf.cast(compat.position_embeddings(self.position_embedding), x.dtype)  # [max_length, embed]
        if context.context_chunks() > 1:  # the sequence split over `context`, in its balanced order: a gather
            positions = features.get("positions", context.token_positions(ids.shape[1]) * tf.ones_like(ids))
            x = x + shard(tf.gather(table(), positions), ACTIVATION_AXES, identity_gradient=True)
        elif "positions" in features:  # per-segment positions, as a one-hot matmul (no gather)
            x = x + tf.einsum("blp,pe->ble", tf.one_hot(features["positions"], self.config.seq_len, dtype=x.dtype), table())
        else:
            x = x + in_order
        x = self.embedding_dropout(x, training=training)
        return shard(x, ACTIVATION_AXES)

    def decode(self, ids: tf.Tensor, positions: tf.Tensor, caches: list) -> tf.Tensor:
        """Logits [batch, n, vocab] of ids [batch, n] at `positions`, each block reading and
        writing its key/value cache (models/decoding.py)."""
        x = self.embed(ids)
        x = x + tf.gather(tf.cast(compat.position_embeddings(self.position_embedding), x.dtype), positions)
        for block, cache in zip(self.blocks, caches):
            x = self.decode_block(block, x, cache)
        return self.output_logits(self.final_hidden(x))

    def decode_block(self, block, x: tf.Tensor, cache) -> tf.Tensor:
        """One block of `decode`: the block with its cache where it takes its mask."""
        return block([x, cache], training=False)

    def final_hidden(self, x: tf.Tensor) -> tf.Tensor:
        """The final layer norm of the last block's output, whole sequences for the output layer."""
        return shard(self.final_norm(x), ("batch", "length", "embed"))

    def embed(self, ids: tf.Tensor) -> tf.Tensor:
        """Token embeddings [batch, length, embed] of ids [batch, length].

        A one-hot matmul when the table's vocab rows are split over devices (and while the
        table does not exist yet), else a gather, whose IndexedSlices gradient the train
        step densifies.
        """
        return choose_lookup(self.token_embedding)(ids)

    def output_table(self) -> tf.Variable:
        """The output layer's [vocab, embed] table: the token embedding (tied)."""
        return self.token_embedding.embeddings

    def stage_layers(self) -> tuple[tuple, tuple]:
        """(the layers a pipeline's first stage holds besides its blocks, the last stage's)."""
        return (self.token_embedding, self.position_embedding), (self.final_norm,)


def choose_lookup(layer):
    """Model Garden's OnDeviceEmbedding `layer`, set to look up by a one-hot matmul when its
    table's vocab rows are split over devices (and while the table does not exist yet),
    else by a gather (its own switch); returns the layer."""
    compat.set_one_hot(layer, not layer.built or rows_split(layer.embeddings))
    return layer


class CausalSelfAttention(tf_keras.layers.Layer):
    """Multi-head self-attention over x [batch, length, embed] with a [batch, length, length] mask.

    The weights are Model Garden's / Keras's MultiHeadAttention's (query, key, value
    [embed, heads, kv] with [heads, kv] biases; attention_output [heads, kv, embed]),
    and so is the math (the query scaled by 1/sqrt(kv), masked positions at -1e9 before
    the softmax, dropout on the probabilities), but the projections are 2-D matmuls and
    the scores and context are batched matmuls over [batch, heads, length, kv].
    With `causal` (the mask never lets a query see a later key, as GPT's) the first half
    of the queries skips the second half of the keys (`fused.attention`).
    """

    def __init__(self, num_heads: int, embed_dim: int, dropout: float, kernel_initializer, causal: bool = False,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_heads, self.embed_dim, self.key_dim = num_heads, embed_dim, embed_dim // num_heads
        self.causal = causal
        heads = (num_heads, self.key_dim)
        self.query, self.key, self.value = (
            Projection((embed_dim,), heads, kernel_initializer(), name=n) for n in ("query", "key", "value"))
        self.attention_output = Projection(heads, (embed_dim,), kernel_initializer(), name="attention_output")
        self.dropout = tf_keras.layers.Dropout(dropout)

    def call(self, x, mask, training=None):
        to_heads = lambda t: tf.transpose(t, [0, 2, 1, 3])  # [batch, length, heads, kv] -> [batch, heads, length, kv]
        q, k, v = to_heads(self.query(x)), to_heads(self.key(x)), to_heads(self.value(x))
        if isinstance(mask, decoding.LayerCache):  # generation: the layer's key/value cache in place of the mask
            return self.attention_output(tf.transpose(mask.attend(q, k, v), [0, 2, 1, 3]))
        context = attention.attend(q, k, v, mask, self.causal, self.dropout, training)  # [batch, heads, length, kv]
        return self.attention_output(tf.transpose(context, [0, 2, 1, 3]))  # [batch, length, embed]

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "embed_dim": self.embed_dim,
                "causal": self.causal}


class Block(tf_keras.layers.Layer):
    """Transformer block: Model Garden's TransformerEncoderBlock, same weights and names,
    built from 2-D matmuls (see Projection).

    block([x [batch, length, embed], mask [batch, length, length]]) -> [batch, length, embed].
    Pre-norm (GPT-2, `norm_first`): x + dropout(attention(norm(x))), then
    + dropout(mlp(norm(.))). Post-norm (BERT): norm(x + dropout(attention(x))), then
    norm(. + dropout(mlp(.))). As Model Garden's, the attention output is dropped at the
    attention dropout rate and the MLP output at the output rate; layer norms compute in
    float32 (a post-norm block's output is float32).

    Args:
      config: num_heads, embed_dim, mlp_dim, dropout, attention_dropout, norm_epsilon and
        activation (a Keras name, unless `activation` is given).
      kernel_initializer: () -> a fresh initializer.
      norm_first: pre-norm (True) or post-norm.
      activation: the MLP's activation function, instead of config.activation.
      causal: the mask is causal (GPT's; see CausalSelfAttention).
    """

    def __init__(self, config: GPTConfig, kernel_initializer, norm_first: bool = True, activation=None,
                 causal: bool = False, **kwargs):
        super().__init__(**kwargs)
        c = self.config = config
        self.norm_first, self.causal = norm_first, causal
        self.attention_layer_norm = tf_keras.layers.LayerNormalization(
            epsilon=c.norm_epsilon, dtype=tf.float32, name="self_attention_layer_norm")
        self.attention = CausalSelfAttention(c.num_heads, c.embed_dim, c.attention_dropout, kernel_initializer,
                                             causal=causal, name="self_attention")
        self.attention_dropout = tf_keras.layers.Dropout(c.attention_dropout)
        self.output_layer_norm = tf_keras.layers.LayerNormalization(
            epsilon=c.norm_epsilon, dtype=tf.float32, name="output_layer_norm")
        self.intermediate = Projection((c.embed_dim,), (c.mlp_dim,), kernel_initializer(), name="intermediate")
        self.activation = activation or fused.activation(c.activation)
        self.output_dense = Projection((c.mlp_dim,), (c.embed_dim,), kernel_initializer(), name="output")
        self.output_dropout = tf_keras.layers.Dropout(c.dropout)

    def call(self, inputs, training=None, output_range=None):
        if output_range is not None:  # Model Garden's encoders pass it (None: every position)
            raise NotImplementedError("Block computes every position (output_range must be None)")
        x, mask = inputs
        if not self.norm_first:
            a = self.attention(tf.cast(x, self.compute_dtype), mask, training=training)
            x = self.attention_layer_norm(x + tf.cast(self.attention_dropout(a, training=training), x.dtype))
            h = self.output_dense(self.activation(self.intermediate(tf.cast(x, self.compute_dtype))))
            return self.output_layer_norm(x + tf.cast(self.output_dropout(h, training=training), x.dtype))
        h = tf.cast(self.attention_layer_norm(x), self.compute_dtype)
        x = x + tf.cast(self.attention_dropout(self.attention(h, mask, training=training), training=training), x.dtype)
        h = tf.cast(self.output_layer_norm(x), self.compute_dtype)
        h = self.output_dense(self.activation(self.intermediate(h)))
        return x + tf.cast(self.output_dropout(h, training=training), x.dtype)

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config), "norm_first": self.norm_first,
                "causal": self.causal}


def attention_mask(ids: tf.Tensor, segment_ids: tf.Tensor | None = None) -> tf.Tensor:
    """The mask the blocks pass their attention: segment ids [batch, length] for blockwise
    attention (tfpod.attention), else `causal_mask`'s [batch, length, length]."""
    return attention.self_attention_mask(ids, segment_ids, causal_mask)


def causal_mask(ids: tf.Tensor, segment_ids: tf.Tensor | None = None) -> tf.Tensor:
    """[batch, length, length]: 1 where query i may attend key j (j <= i, same segment)."""
    length = tf.shape(ids)[1]
    lower = tf.linalg.band_part(tf.ones([length, length], tf.float32), -1, 0)  # [length, length]
    mask = tf.ones_like(ids, tf.float32)[:, :, None] * lower[None, :, :]
    if segment_ids is not None:
        same = tf.cast(tf.equal(segment_ids[:, :, None], segment_ids[:, None, :]), tf.float32)
        mask *= same  # [batch, length, length]
    return mask


def input_signature(config: GPTConfig) -> dict:
    return {"inputs": tf.TensorSpec([None, config.seq_len], tf.int32, name="inputs")}


def batch_signature(config: GPTConfig, batch_size: int) -> dict:
    """Full training batch: model inputs plus targets and weights (static shapes)."""
    return {
        "inputs": tf.TensorSpec([batch_size, config.seq_len], tf.int32),
        "targets": tf.TensorSpec([batch_size, config.seq_len], tf.int32),
        "weights": tf.TensorSpec([batch_size, config.seq_len], tf.float32),
    }


MODEL_FEATURES = ("inputs", "segment_ids", "positions")


def model_inputs(batch: dict) -> dict:
    """The features the model reads."""
    return {k: batch[k] for k in MODEL_FEATURES if k in batch}


def batch_axes() -> dict:
    """Logical axes of each batch feature (the input feed shards `batch`)."""
    return {k: ("batch", "length") for k in ("inputs", "targets", "weights", "segment_ids", "positions")}


def synthetic_batch(config: GPTConfig, batch_size: int, rng: np.random.Generator) -> dict:
    """Random token sequences of the experiment's shapes (train.synthetic_data=True).

    The sequence is a noisy repeating pattern so the loss has something to learn.
    """
    period = 7
    base = rng.integers(0, config.vocab_size, size=(batch_size, period))
    seq = np.tile(base, (1, (config.seq_len + 1) // period + 1))[:, : config.seq_len + 1]
    noise = rng.random(seq.shape) < 0.1
    seq = np.where(noise, rng.integers(0, config.vocab_size, size=seq.shape), seq).astype(np.int32)
    return {
        "inputs": seq[:, :-1],
        "targets": seq[:, 1:],
        "weights": np.ones((batch_size, config.seq_len), np.float32),
    }


def loss_terms(model: GPT, batch: dict, training: bool) -> LossTerms:
    """Next-token cross entropy: [the weighted token losses' sum], averaged over `loss_counts`.

    When the embedding's vocab rows are whole on every device, the tied output layer and
    the loss are one function (`lm_head.output_layer_loss`); when they are split over a mesh axis
    (vocab-parallel), the logits go through `lm_head.loss_from_logits`.

    Returns:
      LossTerms with metrics {"loss_sum", "weight_sum"} (float32 scalars).
    """
    x = model(model_inputs(batch), training=training, return_hidden=True)  # [batch, length, embed]
    return head_terms(model, x, batch)


def loss_counts(batch: dict) -> list:
    """The weighted tokens: what the token losses' sum is averaged over."""
    return [tf.reduce_sum(tf.cast(batch["weights"], tf.float32))]


def head_terms(model: GPT, x: tf.Tensor, batch: dict) -> LossTerms:
    """The loss terms of the final hidden states x [batch, length, embed] (the output table's)."""
    table = model.output_table()
    if rows_split(table):
        sums = lm_head.loss_from_logits(model.output_logits(x), batch)
    else:
        sums = lm_head.output_layer_loss(x, tf.cast(table, x.dtype), batch)
    return LossTerms([sums["loss_sum"]], metrics=sums)


def staged(model: GPT) -> StagedModel:
    """The LM cut for pipeline stages: embeddings first, blocks, final norm + tied output layer + loss last."""
    return StagedModel(
        first=lambda batch, training: model.embed_inputs(model_inputs(batch), training),
        context=lambda batch: attention_mask(batch["inputs"], batch.get("segment_ids")),
        blocks=model.blocks,
        block=model.block_and_aux,
        outputs=lambda x, batch: model.output_logits(model.final_hidden(x)),
        loss_sums=lambda x, batch, training: head_terms(model, model.final_hidden(x), batch).sums,
        activation_axes=ACTIVATION_AXES,
        first_layers=model.stage_layers()[0],
        last_layers=model.stage_layers()[1],
    )




def weight_flops_per_token(config: GPTConfig) -> float:
    """6 * (non-embedding params + the tied output matmul's vocab x embed): the weights' matmuls."""
    e, l, m = config.embed_dim, config.num_layers, config.mlp_dim
    per_layer = 4 * e * e + 2 * e * m  # q, k, v, out + two MLP matmuls
    return 6.0 * (l * per_layer + config.vocab_size * e)


def flops_per_token(config: GPTConfig) -> float:
    """Model FLOPs per trained token (forward + backward), as in the PaLM appendix: the
    weights' matmuls plus the attention score/value matmuls, 12 * layers * length * embed."""
    return weight_flops_per_token(config) + 12.0 * config.num_layers * config.seq_len * config.embed_dim


class GPTTask(Task):
    """The causal LM: gin `gpt.*`, data `lm_data.*` (tfpod.input.lm_data). See tfpod.task.Task."""

    name = "gpt"
    config_class = GPTConfig
    data_name = "lm_data"
    data_config_class = lm_data.LMDataConfig
    default_preset = "tensor"
    axis_rules = AXIS_RULES
    eval_metric = evaluation.LM

    build = staticmethod(GPT)
    input_signature = staticmethod(input_signature)
    flops_per_token = staticmethod(flops_per_token)
    weight_flops_per_token = staticmethod(weight_flops_per_token)
    batch_axes = staticmethod(batch_axes)
    model_inputs = staticmethod(model_inputs)
    synthetic_batch = staticmethod(synthetic_batch)
    make_input = staticmethod(lm_data.lm_input)
    loss_terms = staticmethod(loss_terms)
    loss_counts = staticmethod(loss_counts)
    serving = staticmethod(lm_serving.serving)
    staged = staticmethod(staged)
    pipelines = recomputes = skips_corrupt = serves = True
    plan_profile = staticmethod(functools.partial(plan_profiles.gpt, flops=flops_per_token))

    def tokens_per_example(self, config: GPTConfig) -> int:
        return config.seq_len


TASK = GPTTask()
