"""The Llama family: a pre-norm decoder with RMSNorm, rotary positions, grouped-query
attention and a SwiGLU MLP (Llama 2 and 3, Mistral, Qwen2's query/key/value biases).

  x = embed(ids)                                       no position table: positions rotate q, k
  per block:  h = x + attention(rms_norm(x))           q: heads, k and v: kv_heads (dividing heads)
              x = h + down(silu(gate(rms_norm(h))) * up(rms_norm(h)))
  logits = rms_norm(x) @ output^T                      the token embedding when tied

Rotary embeddings rotate each query and key by its position in the rotate-half form of
Hugging Face's Llama (the first and second halves of a head's dimensions are the pairs),
so its q/k weights load as they are; `rope_scaling_factor` > 0 applies Llama 3.1's
frequency scaling (low and high frequency factors, the original context length).
Grouped-query attention repeats each key/value head for the `num_heads / num_kv_heads`
query heads that share it; under `tensor` the query heads split over `model` and the
key/value heads too where they divide, else they are replicated (logical axis
`kv_heads`). Packed rows (`segment_ids`, `positions`) attend only within their own
document, and positions restart per document.

Batch contract: gpt's (tfpod.models.gpt): inputs, targets, weights, optional segment_ids
and positions, from `lm_data.*`; the loss, eval, serving and pipeline cut are gpt's too.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import tensorflow as tf
import tf_keras
from official.nlp.modeling import layers as mg_layers

from tfpod import UserError, attention, check_positive, fused
from tfpod.input import lm_data
from tfpod.models import decoding, gpt, lm_serving, plan_profiles
from tfpod.partitioning import AxisRule, context, shard

NAME = "llama"
ACTIVATION_AXES = gpt.ACTIVATION_AXES


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of the decoder. Attributes map 1:1 to gin `llama.<name>`.

    Attributes:
      vocab_size: rows of the token embedding (and of the output layer).
      seq_len: tokens per example (rotary positions need no table; serving accepts at most this).
      num_layers, embed_dim, mlp_dim: the blocks, their width, the SwiGLU MLP's
        intermediate size (Llama 3.1 8B: 32, 4096, 14336).
      num_heads: query heads (embed_dim / num_heads dimensions each).
      num_kv_heads: key/value heads, dividing num_heads (num_heads: multi-head attention;
        1: multi-query; 0 means num_heads).
      rope_theta: the rotary embedding's base (Llama 2: 10000; Llama 3: 500000).
      rope_scaling_factor: Llama 3.1's frequency scaling (8.0 for 3.1; 0: none): wavelengths
        longer than rope_original_len / rope_low_freq_factor are divided by it, shorter than
        rope_original_len / rope_high_freq_factor kept, those between interpolated.
      rope_low_freq_factor, rope_high_freq_factor: Llama 3.1's 1.0 and 4.0.
      rope_original_len: the context the unscaled frequencies were trained for (Llama 3.1: 8192).
      norm_epsilon: the RMS norms' epsilon (Llama 2: 1e-5, Llama 3: 1e-5, Mistral 1e-5).
      qkv_bias: biases on the query, key and value projections (Qwen2); no other biases.
      tie_embeddings: the output layer is the token embedding (else its own [vocab, embed]).
      init_stddev: truncated-normal initializer of every weight.
      dropout, attention_dropout: on the residual branches; on the attention
        probabilities (0 in Llama's pretraining; fine-tuning may set them).
      remat: recompute each block's activations in the backward pass.
    """

    vocab_size: int = 8192
    seq_len: int = 128
    num_layers: int = 2
    embed_dim: int = 128
    num_heads: int = 8
    num_kv_heads: int = 0
    mlp_dim: int = 384
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_len: int = 8192
    norm_epsilon: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    init_stddev: float = 0.02
    dropout: float = 0.0
    attention_dropout: float = 0.0
    remat: bool = False

    def __post_init__(self):
        check_positive(self, NAME, ("vocab_size", "seq_len", "num_layers", "embed_dim", "num_heads", "mlp_dim",
                                    "rope_original_len"))
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.embed_dim % self.num_heads:
            raise UserError(f"{NAME}.embed_dim={self.embed_dim} is not divisible by {NAME}.num_heads={self.num_heads}: "
                            "each head gets embed_dim / num_heads dimensions")
        if (self.embed_dim // self.num_heads) % 2:
            raise UserError(f"{NAME}: a head of {self.embed_dim // self.num_heads} dimensions (embed_dim / num_heads) "
                            "cannot be rotated in pairs: make it even")
        if self.num_kv_heads < 0 or self.num_heads % self.num_kv_heads:
            raise UserError(f"{NAME}.num_kv_heads={self.num_kv_heads} does not divide {NAME}.num_heads={self.num_heads}: "
                            "each key/value head serves an equal group of query heads (1: multi-query)")
        if self.rope_theta <= 0 or self.rope_scaling_factor < 0:
            raise UserError(f"{NAME}.rope_theta={self.rope_theta} must be positive and {NAME}.rope_scaling_factor="
                            f"{self.rope_scaling_factor} at least 0 (0: no scaling)")
        if self.rope_scaling_factor and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise UserError(f"{NAME}.rope_low_freq_factor={self.rope_low_freq_factor} must be positive and below "
                            f"{NAME}.rope_high_freq_factor={self.rope_high_freq_factor}")
        for field in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise UserError(f"{NAME}.{field}={getattr(self, field)} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


AXIS_RULES = (
    AxisRule(r".*/token_embedding/embeddings", ("vocab", "embed")),
    AxisRule(r".*/output_embedding/embeddings", ("vocab", "embed"), optional=True),  # untied
    AxisRule(r".*/self_attention/query/kernel", ("embed", "heads", "kv")),
    AxisRule(r".*/self_attention/query/bias", ("heads", "kv"), optional=True),  # qkv_bias
    AxisRule(r".*/self_attention/(key|value)/kernel", ("embed", "kv_heads", "kv")),
    AxisRule(r".*/self_attention/(key|value)/bias", ("kv_heads", "kv"), optional=True),
    AxisRule(r".*/self_attention/attention_output/kernel", ("heads", "kv", "embed")),
    AxisRule(r".*/mlp/(gate|up)/kernel", ("embed", "mlp")),
    AxisRule(r".*/mlp/down/kernel", ("mlp", "embed")),
    AxisRule(r".*(attention_norm|mlp_norm|final_norm)/scale", ("embed",)),
)


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] (float64), with Llama 3.1's scaling:
    wavelengths longer than original_len / low_freq_factor are divided by the factor,
    shorter than original_len / high_freq_factor kept, and those between interpolated."""
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if not config.rope_scaling_factor:
        return inv
    factor, low, high, old = (config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
                              config.rope_original_len)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    between = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rotate(x: tf.Tensor, cos: tf.Tensor, sin: tf.Tensor) -> tf.Tensor:
    """x [batch, length, heads, d] rotated by its positions' angles (cos, sin [batch, length, 1, d / 2]),
    the rotate-half pairing: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). (A custom gradient,
    the rotation back, measured no faster: docs/benchmarks.md.)"""
    x1, x2 = tf.split(x, 2, axis=-1)
    return tf.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class RMSNorm(tf_keras.layers.Layer):
    """x * rsqrt(mean(x^2) + epsilon) * scale over the last axis, computed in float32
    (`fused.rms_norm`: its own two-pass backward)."""

    def __init__(self, epsilon: float, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape):
        self.scale = self.add_weight("scale", [input_shape[-1]], initializer="ones")
        super().build(input_shape)

    def call(self, x):
        return fused.rms_norm(x, self.scale, self.epsilon)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}


class Attention(tf_keras.layers.Layer):
    """Grouped-query self-attention with rotary positions over x [batch, length, embed].

    call(x, mask [batch, length, length], cos, sin [batch, length, 1, head_dim / 2]).
    """

    def __init__(self, config: LlamaConfig, init, **kwargs):
        super().__init__(**kwargs)
        c = self.config = config
        d = c.head_dim
        self.query = gpt.Projection((c.embed_dim,), (c.num_heads, d), init(), use_bias=c.qkv_bias, name="query")
        self.key = gpt.Projection((c.embed_dim,), (c.num_kv_heads, d), init(), use_bias=c.qkv_bias, name="key")
        self.value = gpt.Projection((c.embed_dim,), (c.num_kv_heads, d), init(), use_bias=c.qkv_bias, name="value")
        self.attention_output = gpt.Projection((c.num_heads, d), (c.embed_dim,), init(), use_bias=False,
                                               name="attention_output")
        self.dropout = tf_keras.layers.Dropout(c.attention_dropout)

    def call(self, x, mask, cos, sin, training=None):
        c = self.config
        heads = ("batch", "length", "heads", "kv")
        q = shard(rotate(self.query(x), cos, sin), heads)
        k = rotate(shard(self.key(x), ("batch", "length", "kv_heads", "kv")), cos, sin)
        v = shard(self.value(x), ("batch", "length", "kv_heads", "kv"))
        to_heads = lambda t: tf.transpose(t, [0, 2, 1, 3])  # [batch, heads, length, d]
        if isinstance(mask, decoding.LayerCache):  # generation: the cache (of the key/value heads) for the mask
            return self.attention_output(tf.transpose(mask.attend(to_heads(q), to_heads(k), to_heads(v)), [0, 2, 1, 3]))
        if c.num_kv_heads != c.num_heads:  # each key/value head serves num_heads / num_kv_heads query heads
            if context.context_chunks() > 1:  # gathered over `context` before the repeat: kv_heads' bytes move
                k, v = (shard(t, ("batch", None, "kv_heads", "kv")) for t in (k, v))
                heads = ("batch", None, "heads", "kv")
            k, v = (shard(tf.repeat(t, c.num_heads // c.num_kv_heads, axis=2), heads) for t in (k, v))
        q, k, v = to_heads(q), to_heads(k), to_heads(v)
        attended = attention.attend(q, k, v, mask, True, self.dropout, training)
        return self.attention_output(tf.transpose(attended, [0, 2, 1, 3]))


class Block(tf_keras.layers.Layer):
    """block([x, mask, cos, sin]) -> x: pre-norm attention and SwiGLU MLP, each added to the stream."""

    def __init__(self, config: LlamaConfig, init, **kwargs):
        super().__init__(**kwargs)
        c = self.config = config
        self.attention_norm = RMSNorm(c.norm_epsilon, dtype=tf.float32, name="attention_norm")
        self.attention = Attention(c, init, name="self_attention")
        self.mlp_norm = RMSNorm(c.norm_epsilon, dtype=tf.float32, name="mlp_norm")
        self.mlp = MLP(c, init, name="mlp")
        self.attention_dropout = tf_keras.layers.Dropout(c.dropout)
        self.output_dropout = tf_keras.layers.Dropout(c.dropout)

    def call(self, inputs, training=None):
        x, mask, cos, sin = inputs
        h = tf.cast(self.attention_norm(x), self.compute_dtype)
        a = self.attention(h, mask, cos, sin, training=training)
        x = x + tf.cast(self.attention_dropout(a, training=training), x.dtype)
        h = self.mlp(tf.cast(self.mlp_norm(x), self.compute_dtype))
        return x + tf.cast(self.output_dropout(h, training=training), x.dtype)


class MLP(tf_keras.layers.Layer):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, config: LlamaConfig, init, **kwargs):
        super().__init__(**kwargs)
        e, m = config.embed_dim, config.mlp_dim
        self.gate = gpt.Projection((e,), (m,), init(), use_bias=False, name="gate")
        self.up = gpt.Projection((e,), (m,), init(), use_bias=False, name="up")
        self.down = gpt.Projection((m,), (e,), init(), use_bias=False, name="down")

    def call(self, x):
        return self.down(fused.swiglu(self.gate(x), self.up(x)))


class Llama(gpt.DecoderLM):
    """Causal LM: token ids [batch, length] -> logits [batch, length, vocab] (a gpt.DecoderLM)."""

    def __init__(self, config: LlamaConfig, name: str = NAME):
        super().__init__(name=name)
        self.config = config
        init = lambda: tf_keras.initializers.TruncatedNormal(stddev=config.init_stddev)
        self.token_embedding = mg_layers.OnDeviceEmbedding(config.vocab_size, config.embed_dim, initializer=init(),
                                                           use_one_hot=True, name="token_embedding")
        self.embedding_dropout = tf_keras.layers.Dropout(config.dropout)
        self.blocks = [Block(config, init, name=f"block_{i}") for i in range(config.num_layers)]
        self.final_norm = RMSNorm(config.norm_epsilon, dtype=tf.float32, name="final_norm")
        self.output_embedding = None
        if not config.tie_embeddings:
            self.output_embedding = mg_layers.OnDeviceEmbedding(config.vocab_size, config.embed_dim,
                                                                initializer=init(), name="output_embedding")
        self.inverse_frequencies = rope_frequencies(config).astype(np.float32)

    def angles(self, features: dict):
        """(cos, sin) [batch, length, 1, head_dim / 2] of each token's position (per document when packed)."""
        if "positions" in features:
            positions = tf.cast(features["positions"], tf.float32)
        else:  # 0 .. length - 1 (the length static where known, as DTensor needs; a served row's may vary)
            length = gpt.leading_dims(features["inputs"], 2)[1]
            # (under context parallelism the tokens come in its balanced order: partitioning.context)
            in_order = context.token_positions(length) if isinstance(length, int) else tf.range(length)
            positions = tf.cast(in_order, tf.float32)[None, :] * tf.ones_like(features["inputs"], tf.float32)
        theta = positions[:, :, None, None] * self.inverse_frequencies  # [batch, length, 1, d / 2]
        return tf.cos(theta), tf.sin(theta)

    def context(self, features: dict):
        """What every block reads besides the stream: (mask, cos, sin)."""
        mask = gpt.attention_mask(features["inputs"], features.get("segment_ids"))
        return (mask, *self.angles(features))

    def embed_inputs(self, features: dict, training) -> tf.Tensor:
        x = gpt.choose_lookup(self.token_embedding)(features["inputs"])
        return shard(self.embedding_dropout(x, training=training), ACTIVATION_AXES)

    def run_block(self, block, x, context, training):
        mask, cos, sin = context
        cos, sin = tf.cast(cos, self.compute_dtype), tf.cast(sin, self.compute_dtype)
        if not self.config.remat:
            return block([x, mask, cos, sin], training=training)
        return tf.recompute_grad(lambda x: block([x, mask, cos, sin], training=training))(x)

    def block_and_aux(self, block, x, context, training):
        return self.run_block(block, x, context, training), None

    def call(self, inputs, training=None, return_hidden=False):
        features = inputs if isinstance(inputs, dict) else {"inputs": inputs}
        if self.output_embedding is not None and not self.output_embedding.built:
            self.output_embedding(features["inputs"])  # makes its table, named under this model (once, at build)
        x = self.embed_inputs(features, training)
        context = self.context(features)
        for block in self.blocks:
            x = shard(self.run_block(block, x, context, training), ACTIVATION_AXES)
        x = self.final_hidden(x)
        return x if return_hidden else self.output_logits(x)

    def decode(self, ids: tf.Tensor, positions: tf.Tensor, caches: list) -> tf.Tensor:
        """Logits [batch, n, vocab] of ids [batch, n] at `positions`, each block reading and
        writing its key/value cache (models/decoding.py)."""
        x = gpt.choose_lookup(self.token_embedding)(ids)
        cos, sin = (tf.cast(t, self.compute_dtype) for t in self.angles({"inputs": ids, "positions": positions}))
        for block, cache in zip(self.blocks, caches):
            x = block([x, cache, cos, sin], training=False)
        return self.output_logits(self.final_hidden(x))

    def final_hidden(self, x: tf.Tensor) -> tf.Tensor:
        return shard(tf.cast(self.final_norm(x), self.compute_dtype), ("batch", "length", "embed"))

    def kv_heads(self) -> int:
        """The key/value heads each layer's generation cache holds (grouped-query attention)."""
        return self.config.num_kv_heads

    def output_table(self) -> tf.Variable:
        """The output layer's [vocab, embed] table (the token embedding when tied)."""
        return (self.token_embedding if self.output_embedding is None else self.output_embedding).embeddings

    def stage_layers(self) -> tuple[tuple, tuple]:
        last = (self.final_norm,) + (() if self.output_embedding is None else (self.output_embedding,))
        return (self.token_embedding,), last


def staged(model: Llama):
    """gpt's cut, with the mask and rotary angles as the blocks' context."""
    return dataclasses.replace(gpt.staged(model), context=lambda batch: model.context(gpt.model_inputs(batch)))


def weight_flops_per_token(config: LlamaConfig) -> float:
    """6 x the matmul weights a token passes: q and output projections e x e each, key and
    value e x kv_heads x head_dim each, three SwiGLU matmuls e x mlp, the output layer vocab x e."""
    e, l, kv = config.embed_dim, config.num_layers, config.num_kv_heads * config.head_dim
    per_layer = 2 * e * e + 2 * e * kv + 3 * e * config.mlp_dim
    return 6.0 * (l * per_layer + config.vocab_size * e)


def flops_per_token(config: LlamaConfig) -> float:
    """Model FLOPs per trained token (forward + backward): the weights' matmuls plus the
    attention's score and value matmuls, 12 x layers x length x embed (every query head attends)."""
    return weight_flops_per_token(config) + 12.0 * config.num_layers * config.seq_len * config.embed_dim


class LlamaTask(gpt.GPTTask):
    """The Llama-family decoder: gin `llama.*`; gpt's batches, data (`lm_data.*`), loss, eval and serving."""

    name = NAME
    config_class = LlamaConfig
    axis_rules = AXIS_RULES

    build = staticmethod(Llama)
    make_input = staticmethod(functools.partial(lm_data.lm_input, model=NAME))  # its messages say llama.*
    serving = staticmethod(lm_serving.serving)
    staged = staticmethod(staged)
    flops_per_token = staticmethod(flops_per_token)
    weight_flops_per_token = staticmethod(weight_flops_per_token)
    plan_profile = staticmethod(functools.partial(plan_profiles.llama, flops=flops_per_token))


TASK = LlamaTask()
