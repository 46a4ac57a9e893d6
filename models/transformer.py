"""Transformer translation (MLPerf Transformer big): Model Garden's Seq2SeqTransformer.

The model is tf-models-official's `Seq2SeqTransformer` with its `TransformerEncoder`
and `TransformerDecoder` (pre-norm Transformer blocks, sinusoidal positions, one
embedding shared by source, target and the output layer, as Transformer big), so its
variables carry Model Garden's names. `Seq2SeqTransformer` subclasses it for DTensor:

  * The shared embedding (an `OnDeviceEmbedding`) is switched to one-hot lookups: the
    lookup is a matmul, so a vocab-sharded table needs no gather and its gradient is
    dense (DTensor has no layout propagation for the ResourceScatterAdd of a gathered
    table's IndexedSlices gradient). Its initializer, N(0, hidden^-0.5) as Model
    Garden's, is a Keras one (Model Garden's tf.random_normal_initializer draws with
    stateful random ops, which DTensor cannot place on a mesh).
  * `call` is Model Garden's teacher-forced path (targets shifted right, causal
    self-attention, cross-attention to the source's real tokens, logits by the tied
    embedding), split into `encode` and `decode_hidden` so that greedy decoding runs the
    encoder once per batch. The output layer is an einsum with the [vocab, hidden]
    table instead of Model Garden's reshape to [batch * length, hidden] and back (a
    reshape that merges a batch-sharded dimension); attention masks are built by
    broadcasting instead of reshapes of dynamic shapes.
  * The embedding and each stack's final layer norm get Model Garden's names
    (`on_device_embedding`, `layer_normalization`) explicitly: Model Garden leaves them
    to Keras, which numbers them by how many such layers the process made before.
  * Activations are annotated [batch, length, embed] after the embeddings, the
    encoder and the decoder, and the logits [batch, length, vocab] (vocab-parallel
    under `tensor`).
  * Decoding for BLEU is greedy (`greedy_decode`): a fixed number of full decoder
    passes inside one tf.function, each choosing the next token at one position with
    one-hot products. Model Garden's beam search gathers beams with flattened
    batch * beam offsets (tf.gather_nd over the batch), which a batch-sharded tensor
    cannot do shard-locally, so it is not used.

Batch contract (tfpod.input.translation produces it; the WMT loader's features):
  inputs   int32 [batch, src_len]  source token ids, EOS-terminated, 0 in padding
  targets  int32 [batch, tgt_len]  target token ids, EOS-terminated, 0 in padding (the
           model shifts them right to form the decoder input)
  weights  float32 [batch, tgt_len]  1 for real target tokens (EOS included), 0 padding

Training minimizes label-smoothed cross entropy over the target tokens (smoothing 0.1
as MLPerf; Model Garden's translation task's `_padded_cross_entropy_loss`: the
smoothed cross entropy minus its minimum, so a perfect model scores 0). Evaluation sums
plain cross entropy, the smoothed loss and token accuracy on device (EVAL_METRIC), and
`decode_metrics` adds corpus BLEU (sacrebleu) of greedy decodes over all hosts.
`serving` gives --mode=export a signature that translates raw strings.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import weakref

import numpy as np
import tensorflow as tf
import tf_keras
from official.nlp.modeling import layers as mg_layers
from official.nlp.modeling import models as mg_models

from tfpod import UserError, attention, attention_layers, compat, evaluation
from tfpod.input import translation as translation_data
from tfpod.partitioning import AxisRule, shard
from tfpod.models import plan_profiles
from tfpod.models.bleu import bleu_from_statistics, bleu_statistics
from tfpod.task import EvalContext, LossTerms, Task

log = logging.getLogger("tfpod")

ACTIVATIONS = ("relu", "gelu")
ACTIVATION_AXES = ("batch", "length", "embed")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape, loss and decoding of the Transformer. Attributes map 1:1 to gin
    `transformer.<name>`; the defaults are Transformer big (MLPerf).

    Attributes:
      vocab_size: rows of the shared embedding; at least the SentencePiece model's
        pieces (pad it to a multiple of the model axis, e.g. 33708 -> 33792).
      src_len, tgt_len: source and target tokens per training example, EOS included
        (the WMT loader's max_seq_length); longer training pairs are filtered or
        truncated (translation_data.long_pairs), eval pairs truncated to these or to
        translation_data.eval_max_length (the sinusoidal positions take any length).
      encoder_layers, decoder_layers: blocks of each stack.
      hidden_size, num_heads, intermediate_size: the blocks' width, attention heads and
        feed-forward width.
      dropout: on the embeddings and every residual branch.
      attention_dropout: on the attention probabilities.
      intermediate_dropout: after the feed-forward activation (relu dropout).
      activation: of the feed-forward layer (relu, as the paper; or gelu).
      norm_first: pre-norm blocks (Model Garden's translation default) instead of post-norm.
      label_smoothing: weight of the uniform distribution in the training targets.
      decode_max_length: greedy decoding steps for BLEU (None: tgt_len); the sinusoidal
        positions let it exceed tgt_len.
      decode_examples: eval examples decoded for BLEU over all hosts (split evenly;
        None: all; 0: no BLEU).
      bleu_lowercase: case-insensitive BLEU (MLPerf reports uncased BLEU).
      vocab_path: SentencePiece model that detokenizes decodes and references for BLEU
        (Model Garden's TranslationConfig.sentencepiece_model_path) when
        translation_data.vocab_path is unset (that one wins: the input, BLEU and serving
        use one vocabulary, translation_data's `vocabulary`); None: the prepared corpus's.
    """

    vocab_size: int = 33792
    src_len: int = 64
    tgt_len: int = 64
    encoder_layers: int = 6
    decoder_layers: int = 6
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    dropout: float = 0.1
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.1
    activation: str = "relu"
    norm_first: bool = True
    label_smoothing: float = 0.1
    decode_max_length: int | None = None
    decode_examples: int | None = None
    bleu_lowercase: bool = True
    vocab_path: str | None = None

    def __post_init__(self):
        for field in ("vocab_size", "src_len", "tgt_len", "encoder_layers", "decoder_layers", "hidden_size",
                      "num_heads", "intermediate_size"):
            if getattr(self, field) < 1:
                raise UserError(f"transformer.{field}={getattr(self, field)} must be positive")
        if self.hidden_size % self.num_heads:
            raise UserError(
                f"transformer.hidden_size={self.hidden_size} is not divisible by transformer.num_heads="
                f"{self.num_heads}: each head gets hidden_size / num_heads dimensions"
            )
        for field in ("dropout", "attention_dropout", "intermediate_dropout", "label_smoothing"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise UserError(f"transformer.{field}={getattr(self, field)} must be in [0, 1)")
        if self.activation not in ACTIVATIONS:
            raise UserError(f"transformer.activation={self.activation!r}: use one of {', '.join(ACTIVATIONS)}")
        if self.decode_max_length is not None and self.decode_max_length < 1:
            raise UserError(f"transformer.decode_max_length={self.decode_max_length} must be at least 1 (or None: "
                            "transformer.tgt_len)")
        if self.decode_examples is not None and self.decode_examples < 0:
            raise UserError(f"transformer.decode_examples={self.decode_examples} must be >= 0 (None: every eval "
                            "example)")

    @property
    def seq_len(self) -> int:
        """Tokens per example, source plus target (the trainer's tokens/s counts these)."""
        return self.src_len + self.tgt_len

    @property
    def decode_length(self) -> int:
        return self.decode_max_length or self.tgt_len


# Variable names are "transformer/<embedding, encoder or decoder>/.../<weight>". Model
# Garden's translation blocks have no attention biases (use_bias=False). Megatron under
# `tensor`: column-parallel query/key/value and MLP-in, row-parallel attention-out and
# MLP-out, the vocab-parallel shared embedding and output layer.
AXIS_RULES = (
    AxisRule(r".*/on_device_embedding/embeddings", ("vocab", "embed")),
    AxisRule(r".*/(self_attention|attention/encdec)/(query|key|value)/kernel", ("embed", "heads", "kv")),
    AxisRule(r".*/(self_attention|attention/encdec)/attention_output/kernel", ("heads", "kv", "embed")),
    AxisRule(r".*/layer_\d+/intermediate/kernel", ("embed", "mlp")),
    AxisRule(r".*/layer_\d+/intermediate/bias", ("mlp",)),
    AxisRule(r".*/layer_\d+/output/kernel", ("mlp", "embed")),
    AxisRule(r".*/layer_\d+/output/bias", ("embed",)),
    AxisRule(r".*/layer_\d+/(self_attention_layer_norm|attention/encdec_output_layer_norm|output_layer_norm)"
             r"/(gamma|beta)", ("embed",)),
    AxisRule(r".*/(encoder|decoder)/layer_normalization/(gamma|beta)", ("embed",)),  # each stack's final norm
)


class _FinalNormNamed:
    """Names a Model Garden stack's final layer norm `layer_normalization` (Model Garden
    leaves it to Keras, which numbers it by how many layer norms the process made
    before), so variable names, rules and layout reports are the same in every process."""

    def build(self, input_shape):
        super().build(input_shape)
        compat.rename_layer(self.output_normalization, "layer_normalization")  # before it builds its weights
        for block in compat.flatten_layers(self, include_self=False):  # their attention layers: blockwise stand-ins
            if isinstance(block, (mg_layers.TransformerEncoderBlock, mg_layers.TransformerDecoderBlock)):
                attention_layers.use_blockwise_when_built(block, decoder_self_attention=True)


class TransformerEncoder(_FinalNormNamed, mg_models.TransformerEncoder):
    pass


class TransformerDecoder(_FinalNormNamed, mg_models.TransformerDecoder):
    pass


class Seq2SeqTransformer(mg_models.Seq2SeqTransformer):
    """Model Garden's Seq2SeqTransformer for DTensor (see the module docstring).

    {inputs [batch, src_len], targets [batch, tgt_len]} -> logits [batch, tgt_len,
    vocab] (float32), position t predicting targets[:, t] from targets[:, :t].
    """

    def __init__(self, config: TransformerConfig, name: str = "transformer"):
        def stack(cls, layers, stack_name):
            return cls(num_layers=layers, num_attention_heads=config.num_heads,
                       intermediate_size=config.intermediate_size, activation=config.activation,
                       dropout_rate=config.dropout, attention_dropout_rate=config.attention_dropout,
                       use_bias=False, norm_first=config.norm_first, norm_epsilon=1e-6,
                       intermediate_dropout=config.intermediate_dropout, name=stack_name)

        super().__init__(
            vocab_size=config.vocab_size,
            embedding_width=config.hidden_size,
            dropout_rate=config.dropout,
            decode_max_length=config.decode_length,
            beam_size=1,
            encoder_layer=stack(TransformerEncoder, config.encoder_layers, "encoder"),
            decoder_layer=stack(TransformerDecoder, config.decoder_layers, "decoder"),
            eos_id=translation_data.EOS_ID,
            name=name,
        )
        self.config = config
        if not isinstance(self.embedding_lookup, mg_layers.OnDeviceEmbedding):
            raise TypeError(f"Seq2SeqTransformer's embedding is a {type(self.embedding_lookup).__name__}, not an "
                            "OnDeviceEmbedding")
        compat.set_one_hot(self.embedding_lookup, True)
        compat.rename_layer(self.embedding_lookup, "on_device_embedding")  # Model Garden's name, not numbered
        # Model Garden's N(0, hidden^-0.5) as a Keras initializer: tf.random_normal_initializer
        # draws with stateful TF random ops, which DTensor cannot place on the mesh.
        compat.set_embedding_initializer(self.embedding_lookup, tf_keras.initializers.RandomNormal(
            mean=0.0, stddev=config.hidden_size ** -0.5))

    def encode(self, sources: tf.Tensor, training=None):
        """sources [batch, src_len] -> (memory [batch, src_len, hidden], source_mask [batch, src_len] float)."""
        source_mask = tf.cast(tf.not_equal(sources, 0), tf.float32)  # 1 for real source tokens
        x = self.embedding_lookup(sources)  # [batch, src_len, hidden], scaled by sqrt(hidden)
        x = x * tf.cast(source_mask, x.dtype)[:, :, None]
        x = x + tf.cast(self.position_embedding(x), x.dtype)  # sinusoids [src_len, hidden]
        x = self.encoder_dropout(x, training=training)
        x = shard(x, ACTIVATION_AXES)
        # every query attends to the real source tokens: [batch, 1, key] (blockwise) or [batch, query, key]
        self_mask = _key_mask(source_mask, tf.ones_like(source_mask))
        memory = self.encoder_layer(x, attention_mask=self_mask, training=training)
        return shard(memory, ACTIVATION_AXES), source_mask

    def decode_hidden(self, memory: tf.Tensor, source_mask: tf.Tensor, targets: tf.Tensor, training=None):
        """The decoder's output [batch, tgt_len, hidden] for teacher-forced targets [batch, tgt_len]."""
        shifted = tf.pad(targets, [[0, 0], [1, 0]])[:, :-1]  # decoder input: 0 (start), targets[:-1]
        x = self.embedding_lookup(shifted)  # [batch, tgt_len, hidden]
        x = x + tf.cast(self.position_embedding(x), x.dtype)
        x = self.decoder_dropout(x, training=training)
        x = shard(x, ACTIVATION_AXES)
        length = targets.shape[1] or tf.shape(targets)[1]
        ones = tf.ones_like(shifted, tf.float32)[:, :, None]  # [batch, tgt_len, 1]
        causal = tf.linalg.band_part(tf.ones([length, length], tf.float32), -1, 0)  # [tgt_len, tgt_len]
        self_mask = ones * causal[None, :, :]  # [batch, tgt_len, tgt_len]
        if attention.current().segment_masks:  # the decoder's self-attention layers are causal
            self_mask = tf.expand_dims(tf.ones_like(shifted, tf.float32), 1)  # [batch, 1, tgt_len]: no padding
        cross_mask = _key_mask(source_mask, tf.ones_like(shifted, tf.float32))  # [batch, 1 or tgt_len, src_len]
        hidden = self.decoder_layer(x, memory, self_attention_mask=self_mask, cross_attention_mask=cross_mask,
                                    training=training)
        return shard(hidden, ACTIVATION_AXES)

    def logits(self, hidden: tf.Tensor) -> tf.Tensor:
        """hidden [batch, (length,) hidden] -> logits [batch, (length,) vocab] (float32)
        by the shared embedding (DTensor's einsum has no `...` broadcasting)."""
        table = tf.cast(self.embedding_lookup.embeddings, hidden.dtype)  # [vocab, hidden]
        equation = "blh,vh->blv" if hidden.shape.rank == 3 else "bh,vh->bv"
        return tf.cast(tf.einsum(equation, hidden, table), tf.float32)

    def call(self, inputs, training=None):
        memory, source_mask = self.encode(inputs["inputs"], training=training)
        hidden = self.decode_hidden(memory, source_mask, inputs["targets"], training=training)
        return shard(self.logits(hidden), ("batch", "length", "vocab"))  # [batch, tgt_len, vocab]


def _key_mask(keys: tf.Tensor, queries: tf.Tensor) -> tf.Tensor:
    """keys [batch, S] (1 for a real token) as the mask of queries [batch, T]: [batch, 1, S] for
    blockwise attention (a key mask, tfpod.attention_layers), else [batch, T, S]."""
    if attention.current().segment_masks:
        return tf.expand_dims(keys, 1)
    return tf.expand_dims(queries, 2) * tf.expand_dims(keys, 1)


def greedy_decode(model: Seq2SeqTransformer, sources: tf.Tensor, length: int) -> tf.Tensor:
    """Greedy decoding: sources [batch, src_len] -> ids [batch, length] int32.

    Step t runs the decoder over the whole fixed-length prefix (later positions hold 0
    and, being causally masked, do not affect position t), takes the logits at position
    t with a one-hot product and writes their argmax at t. Rows keep decoding after
    their EOS; the caller cuts each row at its first EOS.
    """
    memory, source_mask = model.encode(sources, training=False)
    ids = tf.zeros_like(sources[:, :1]) + tf.zeros([1, length], sources.dtype)  # [batch, length]
    ids = shard(ids, ("batch", "length"))
    for t in tf.range(length):
        hidden = model.decode_hidden(memory, source_mask, ids, training=False)  # [batch, length, hidden]
        at_t = tf.one_hot(t, length, dtype=hidden.dtype)  # [length]
        logits = model.logits(tf.einsum("blh,l->bh", hidden, at_t))  # [batch, vocab]
        logits = shard(logits, ("batch", None))  # whole rows for the argmax
        best = tf.argmax(logits, axis=-1, output_type=tf.int32)  # [batch]
        ids = ids + best[:, None] * tf.one_hot(t, length, dtype=tf.int32)[None, :]
        ids = shard(ids, ("batch", "length"))
    return ids


MODEL_FEATURES = ("inputs", "targets")


def input_signature(config: TransformerConfig) -> dict:
    return {
        "inputs": tf.TensorSpec([None, config.src_len], tf.int32, name="inputs"),
        "targets": tf.TensorSpec([None, config.tgt_len], tf.int32, name="targets"),
    }


def model_inputs(batch: dict) -> dict:
    """The features the model reads (targets are shifted right inside the model)."""
    return {k: batch[k] for k in MODEL_FEATURES}


def batch_axes() -> dict:
    """Logical axes of each batch feature (the input feed shards `batch`; `inputs` first)."""
    return {k: ("batch", "length") for k in ("inputs", "targets", "weights")}


def synthetic_batch(config: TransformerConfig, batch_size: int, rng: np.random.Generator) -> dict:
    """Random pairs of the experiment's shapes (train.synthetic_data=True).

    A source is a random-length run of random ids; its target is the source's first
    tokens reversed (so the loss has something to learn), both EOS-terminated and
    0-padded.
    """
    first = min(translation_data.FIRST_PIECE, config.vocab_size - 1)  # ids below are special
    eos = min(translation_data.EOS_ID, config.vocab_size - 1)
    inputs = np.zeros((batch_size, config.src_len), np.int32)
    targets = np.zeros((batch_size, config.tgt_len), np.int32)
    weights = np.zeros((batch_size, config.tgt_len), np.float32)
    for row in range(batch_size):
        n = int(rng.integers(1, config.src_len))  # source tokens before EOS
        source = rng.integers(first, config.vocab_size, size=n)
        inputs[row, :n], inputs[row, n] = source, eos
        m = min(n, config.tgt_len - 1)
        targets[row, :m], targets[row, m] = source[:m][::-1], eos
        weights[row, :m + 1] = 1.0
    return {"inputs": inputs, "targets": targets, "weights": weights}


def _smoothed_cross_entropy(logits: tf.Tensor, labels: tf.Tensor, smoothing: float):
    """(plain, label-smoothed) cross entropy per position, from logits [..., vocab].

    The smoothed targets put 1 - smoothing on the label and smoothing / (vocab - 1) on
    every other id; the smoothed loss has its minimum (the targets' entropy) subtracted,
    as Model Garden's `_padded_cross_entropy_loss`. Both are logsumexp minus sums over
    the vocabulary (the label's logit picked by a one-hot product), so vocab-sharded
    logits reduce with all-reduces instead of being gathered.
    """
    vocab = logits.shape[-1]
    log_z = tf.reduce_logsumexp(logits, axis=-1)
    label_logit = tf.reduce_sum(logits * tf.one_hot(labels, vocab, dtype=logits.dtype), axis=-1)
    plain = log_z - label_logit
    if not smoothing:
        return plain, plain
    confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
    expected_logit = low * tf.reduce_sum(logits, axis=-1) + (confidence - low) * label_logit
    minimum = -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low + 1e-20))
    return plain, log_z - expected_logit - minimum


def loss_terms(model: Seq2SeqTransformer, batch: dict, training: bool) -> LossTerms:
    """Label-smoothed cross entropy: [its sum over the real target tokens], averaged over
    `loss_counts` (the global batch's real target tokens).

    Returns:
      LossTerms with metrics {"loss_sum", "weight_sum", "cross_entropy"} (float32 scalars;
      cross_entropy: this batch's plain, unsmoothed one).
    """
    logits = model(model_inputs(batch), training=training)  # [batch, tgt_len, vocab]
    weights = tf.cast(batch["weights"], tf.float32)  # [batch, tgt_len]
    plain, smoothed = _smoothed_cross_entropy(logits, batch["targets"], model.config.label_smoothing)
    weight_sum = tf.reduce_sum(weights)
    loss_sum = tf.reduce_sum(smoothed * weights)
    return LossTerms([loss_sum], metrics={"loss_sum": loss_sum, "weight_sum": weight_sum,
                                          "cross_entropy": tf.reduce_sum(plain * weights) / tf.maximum(weight_sum, 1.0)})


def loss_counts(batch: dict) -> list:
    """The real target tokens: what the token losses' sum is averaged over."""
    return [tf.reduce_sum(tf.cast(batch["weights"], tf.float32))]


EVAL_SMOOTHING = 0.1  # the smoothing of the eval's smoothed_loss (MLPerf's), whatever the training's


def _metric_update(logits: tf.Tensor, batch) -> dict:
    """Sums over the target tokens of one eval batch: logits [batch, tgt_len, vocab]."""
    weights = tf.cast(batch["weights"], tf.float32)
    plain, smoothed = _smoothed_cross_entropy(logits, batch["targets"], EVAL_SMOOTHING)
    correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), batch["targets"]), tf.float32)
    return {
        "loss_sum": tf.reduce_sum(plain * weights),
        "smoothed_loss_sum": tf.reduce_sum(smoothed * weights),
        "token_count": tf.reduce_sum(weights),
        "correct_tokens": tf.reduce_sum(correct * weights),
        "example_count": tf.reduce_sum(tf.cast(tf.reduce_max(weights, axis=1) > 0, tf.float32)),  # real rows
    }


def _metric_result(sums) -> dict:
    tokens = max(sums["token_count"], 1.0)
    loss = sums["loss_sum"] / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "token_accuracy": sums["correct_tokens"] / tokens,
            "smoothed_loss": sums["smoothed_loss_sum"] / tokens}


# Teacher-forced sums over the target tokens: plain cross entropy (`loss`, `perplexity`),
# the label-smoothed loss with smoothing EVAL_SMOOTHING (`smoothed_loss`) and next-token accuracy.
EVAL_METRIC = evaluation.Metric("translation", _metric_update, _metric_result)


# ---------------------------------------------------------------------------
# BLEU of greedy decodes (the task's host_eval_metrics, after the device metrics)

_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> compiled greedy decode
def _decoder(model: Seq2SeqTransformer, length: int):
    fn = _DECODERS.get(model)
    if fn is None:
        fn = tf.function(lambda sources: greedy_decode(model, sources, length))
        _DECODERS[model] = fn
    return fn


def _cut(ids, eos: int, size: int) -> list[int]:
    """Ids up to (not including) the first EOS, without padding or ids past the vocabulary."""
    out = []
    for i in ids:
        if i == eos:
            break
        if 0 < i < size:
            out.append(int(i))
    return out


def decode_rows(host_batches, decode_examples: int | None, num_hosts: int, host_id: int) -> dict:
    """This host's rows to decode: its real eval rows (any weight > 0; padding rows have
    all-zero weights) in order, at most its share of `decode_examples` (split evenly
    over hosts, the first hosts one more), as {inputs, targets, weights} arrays."""
    rows = {k: np.concatenate([b[k] for b in host_batches]) for k in ("inputs", "targets", "weights")}
    real = rows["weights"].max(axis=1) > 0
    rows = {k: v[real] for k, v in rows.items()}
    if decode_examples is not None:
        base, extra = divmod(decode_examples, num_hosts)
        rows = {k: v[:base + (1 if host_id < extra else 0)] for k, v in rows.items()}
    return rows


def decode_metrics(context: EvalContext, host_batches) -> dict:
    """Corpus BLEU of greedy decodes of the first transformer.decode_examples eval examples.

    Every host decodes its share of the examples (its first real rows) on the mesh,
    detokenizes hypotheses and references (the target ids up to EOS) with the
    SentencePiece model, computes sacrebleu's sufficient statistics, and the hosts sum
    them (EvalContext.host_sum) before BLEU is computed, so the score is the corpus BLEU
    of all decoded examples, whatever the host count. Padding rows (weight 0) are
    never decoded into the statistics.

    Returns:
      {"bleu": corpus BLEU 0-100, "decoded_examples": float count}.
    """
    cfg = context.model_config
    if cfg.decode_examples == 0:
        return {}
    data = context.data_config  # the input's vocabulary (translation_data.vocabulary), else the model's
    vocab = translation_data.vocabulary(data, cfg.vocab_path) if data is not None else cfg.vocab_path
    if not vocab:
        raise UserError("transformer.vocab_path is unset and no translation_data config was given: BLEU needs the "
                        "SentencePiece model to detokenize decodes; set transformer.vocab_path")
    tokenizer = translation_data.sentencepiece(vocab)
    eos, size = tokenizer.eos_id(), tokenizer.get_piece_size()
    rows = decode_rows(host_batches, cfg.decode_examples, context.num_hosts, context.host_id)
    n, per = len(rows["inputs"]), context.host_rows
    batches = [{"inputs": rows["inputs"][i:i + per]} for i in range(0, n, per)]
    padding = {"inputs": np.zeros((per, rows["inputs"].shape[1]), np.int32)}  # for a host with nothing to decode
    decode = _decoder(context.model, cfg.decode_length)
    outputs = context.run_padded(lambda b: decode(b["inputs"]), batches, {"inputs": batch_axes()["inputs"]}, padding)
    decoded = np.concatenate(outputs) if outputs else np.zeros((0, cfg.decode_length), np.int32)
    hypotheses = [tokenizer.decode(_cut(r, eos, size)) for r in decoded]
    references = [tokenizer.decode(_cut(r, eos, size)) for r in rows["targets"]]
    if context.is_chief:
        for ref, hyp in list(zip(references, hypotheses))[:3]:
            log.info("decode: %r -> %r", ref, hyp)
    totals = context.host_sum(np.concatenate([bleu_statistics(hypotheses, references, cfg.bleu_lowercase), [n]]))
    return {"bleu": bleu_from_statistics(totals[:-1]), "decoded_examples": float(totals[-1])}


def serving(model: Seq2SeqTransformer, config: TransformerConfig, data_config) -> tuple[tf.Module, dict]:
    """The translator's SavedModel signature (tfpod.export), on raw source strings.

    A source is tokenized in the graph with the run's SentencePiece model, cut to
    src_len - 1 pieces plus EOS (as the eval input), and decoded greedily for
    decode_max_length steps; the output ids stop at the first EOS.

      serving_default(text string [batch]) ->
        translation string [batch]  the detokenized decode
        ids int32 [batch, decode_length]  its ids, 0 from the first EOS on
    """
    from tfpod.input import text as text_lib

    vocab_path = translation_data.vocabulary(data_config, config.vocab_path)
    tokenizer = text_lib.load_tokenizer(vocab_path)
    processor = translation_data.sentencepiece(vocab_path)
    eos, pieces, unk = processor.eos_id(), processor.get_piece_size(), processor.unk_id()
    module = tf.Module()
    module.model, module.tokenizer = model, tokenizer
    length = config.decode_length

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def serving_default(texts):
        source = tokenizer.tokenize(texts)[:, : config.src_len - 1]  # ragged [batch, pieces]
        eos_column = tf.RaggedTensor.from_tensor(tf.fill([tf.shape(texts)[0], 1], eos))
        sources = tf.concat([source, eos_column], axis=1).to_tensor(0, shape=[None, config.src_len])
        ids = greedy_decode(model, sources, length)  # [batch, length]
        before_eos = tf.equal(tf.cumsum(tf.cast(tf.equal(ids, eos), tf.int32), axis=1), 0)
        ids = tf.where(before_eos, ids, 0)
        kept = tf.where(ids < pieces, ids, unk)  # ids of padded vocabulary rows are unknown pieces
        words = tf.RaggedTensor.from_tensor(kept, lengths=tf.reduce_sum(tf.cast(before_eos, tf.int32), axis=1))
        return {"translation": tokenizer.detokenize(words), "ids": ids}

    return module, {"serving_default": serving_default.get_concrete_function()}


def flops_per_token(config: TransformerConfig) -> float:
    """Model FLOPs per trained token (source and target tokens; forward + backward,
    6 per multiply-add weight, PaLM appendix B).

    Per source token the encoder's matmuls (4 h^2 attention + 2 h f feed-forward per
    layer) and the decoder's cross-attention keys and values (2 h^2 per layer); per
    target token the decoder's self-attention (4 h^2), cross-attention queries and
    output (2 h^2), feed-forward (2 h f) and the tied output layer (vocab x h); plus
    attention scores and values, 12 * layers * h * (keys attended) per query token.
    The total per example is spread over its src_len + tgt_len tokens.
    """
    h, f, s, t = config.hidden_size, config.intermediate_size, config.src_len, config.tgt_len
    le, ld = config.encoder_layers, config.decoder_layers
    per_source = 6.0 * (le * (4 * h * h + 2 * h * f) + ld * 2 * h * h) + 12.0 * le * s * h
    per_target = 6.0 * (ld * (6 * h * h + 2 * h * f) + config.vocab_size * h) + 12.0 * ld * (t + s) * h
    return (s * per_source + t * per_target) / (s + t)


class TransformerTask(Task):
    """Translation with the Transformer (MLPerf): gin `transformer.*`, data `translation_data.*`.

    Besides the on-device metrics, evaluation decodes greedily and reports corpus BLEU
    (`host_eval_metrics`).
    """

    name = "transformer"
    config_class = TransformerConfig
    data_name = "translation_data"
    data_config_class = translation_data.TranslationDataConfig
    default_preset = "tensor"
    axis_rules = AXIS_RULES
    eval_metric = EVAL_METRIC

    build = staticmethod(Seq2SeqTransformer)
    input_signature = staticmethod(input_signature)
    flops_per_token = staticmethod(flops_per_token)
    batch_axes = staticmethod(batch_axes)
    model_inputs = staticmethod(model_inputs)
    synthetic_batch = staticmethod(synthetic_batch)
    make_input = staticmethod(translation_data.translation_input)
    loss_terms = staticmethod(loss_terms)
    loss_counts = staticmethod(loss_counts)
    host_eval_metrics = staticmethod(decode_metrics)
    serving = staticmethod(serving)
    skips_corrupt = serves = True
    plan_profile = staticmethod(functools.partial(plan_profiles.transformer, flops=flops_per_token))

    def tokens_per_example(self, config: TransformerConfig) -> int:
        return config.seq_len  # source plus target


TASK = TransformerTask()
