"""BERT pretraining (MLPerf BERT): masked LM, optionally next-sentence prediction.

The encoder is Model Garden's `BertEncoderV2` (post-norm Transformer blocks, word,
position and token-type embeddings, embedding layer norm, pooler), so its variables
carry Model Garden's names. Three of its pieces are changed, for DTensor and for speed:

  * Its blocks are gpt's `Block` in post-norm mode: Model Garden's
    TransformerEncoderBlock with the same weights, names and math, written as 2-D
    matmuls (oneDNN runs their gradients faster than EinsumDense's einsums).
  * The word embedding (an `OnDeviceEmbedding`) is a gather when its vocab rows are
    whole on every device and a one-hot matmul when they are split over a mesh axis
    (a vocab-sharded table then needs no gather; the trainer densifies the gather's
    IndexedSlices gradient, for which DTensor has no ResourceScatterAdd layout); the
    one-hot matmul costs 2 x vocab x hidden FLOPs per token that count for nothing. The
    token-type embedding is one-hot already.
  * The masked-LM head is Model Garden's `MaskedLM` (its weights: `transform/dense`,
    `transform/LayerNorm`, `output_bias`) with the gather of masked positions written
    as a one-hot einsum over the sequence (Model Garden flattens the batch and gathers
    with global row offsets, which a batch-sharded tensor cannot do shard-locally). Its
    output layer is tied to the word embeddings, so under `tensor` the logits and the
    cross entropy are vocab-parallel.

The encoder's output is annotated [batch, length, embed] (tfpod.sharding.shard) before
both heads, and the NSP head applies the encoder's pooler to that annotated tensor.
Without it, under the `weight_update` preset, DTensor's SPMD expansion of a reduction
in the encoder's post-norm blocks failed ("EmitAllScatter was passed a desired_layout
... which was not more sharded than the original_layout"; pre-norm blocks did not), as
layouts propagated back from the gradients' relayouts.

Next-sentence prediction (`next_sentence=True`, as in Google's and the MLPerf reference
run_pretraining.py) trains a 2-way classifier on the pooled [CLS] output and adds its
loss; without it the pooler and the classifier are frozen (no gradient, no optimizer
state), so checkpoints have the same variables either way.

Batch contract (the features of tf-models-official's create_pretraining_data.py; see
tfpod.input.bert_data for the pipelines that produce it):
  input_ids            int32 [batch, length]  token ids, [CLS] first, 0 in padding
  input_mask           int32 [batch, length]  1 for tokens, 0 for padding
  segment_ids          int32 [batch, length]  0 for sentence A (and padding), 1 for B
  masked_lm_positions  int32 [batch, predictions]  positions to predict, 0 in padding
  masked_lm_ids        int32 [batch, predictions]  the original ids there
  masked_lm_weights    float32 [batch, predictions]  1 per real prediction, 0 padding
  next_sentence_labels int32 [batch]  1 if sentence B is random (read with
                       next_sentence=True; online-masked text has none)
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import tensorflow as tf
import tf_keras
from official.nlp.modeling import layers as mg_layers
from official.nlp.modeling import networks as mg_networks

from tfpod import UserError, attention, check_positive, compat, evaluation, fused
from tfpod.input import bert_data
from tfpod.models import gpt, lm_serving
from tfpod.partitioning import AxisRule, shard
from tfpod.models import plan_profiles
from tfpod.task import LossTerms, StagedModel, Task

ACTIVATIONS = ("gelu", "gelu_approximate", "relu")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Shape of BERT. Attributes map 1:1 to gin `bert.<name>`; the defaults are BERT-large.

    Attributes:
      vocab_size: word pieces (30522 for BERT's uncased WordPiece vocabulary).
      seq_len: tokens per example, [CLS] and [SEP]s included (create_pretraining_data.py
        --max_seq_length); also the size of the position table.
      max_predictions: masked positions per example (--max_predictions_per_seq).
      num_layers, hidden_size, num_heads, intermediate_size: the encoder's shape.
      type_vocab_size: token types (segments A and B).
      dropout, attention_dropout: dropout rates (BERT: 0.1).
      init_stddev: truncated-normal initializer of every weight.
      activation: the MLP's activation, gelu (exact, as Google's BERT), gelu_approximate
        (tanh form) or relu.
      next_sentence: also train next-sentence prediction (needs next_sentence_labels,
        which create_pretraining_data.py writes).
      norm_first: pre-norm blocks (layer norm before attention and MLP) instead of
        BERT's post-norm ones.
    """

    vocab_size: int = 30522
    seq_len: int = 512
    max_predictions: int = 76
    num_layers: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    type_vocab_size: int = 2
    dropout: float = 0.1
    attention_dropout: float = 0.1
    init_stddev: float = 0.02
    activation: str = "gelu"
    next_sentence: bool = False
    norm_first: bool = False

    def __post_init__(self):
        check_positive(self, "bert", ("vocab_size", "seq_len", "max_predictions", "num_layers", "hidden_size",
                                      "num_heads", "intermediate_size", "type_vocab_size"))
        if self.hidden_size % self.num_heads:
            raise UserError(
                f"bert.hidden_size={self.hidden_size} is not divisible by bert.num_heads={self.num_heads}: "
                "each head gets hidden_size / num_heads dimensions"
            )
        if self.max_predictions > self.seq_len:
            raise UserError(f"bert.max_predictions={self.max_predictions} exceeds bert.seq_len={self.seq_len}: "
                            "an example cannot predict more positions than it has")
        for field in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise UserError(f"bert.{field}={getattr(self, field)} must be in [0, 1)")
        if self.activation not in ACTIVATIONS:
            raise UserError(f"bert.activation={self.activation!r}: use one of {', '.join(ACTIVATIONS)}")

NORM_EPSILON = 1e-12  # of BertEncoderV2's blocks (TransformerEncoderBlock's default) and Google BERT's

# Variable names are "bert/<encoder or head>/.../<weight>"; one rule per kind of weight.
# The encoder's blocks are Model Garden TransformerEncoderBlocks (post-norm, as BERT):
# column-parallel query/key/value and MLP-in, row-parallel attention-out and MLP-out.
AXIS_RULES = (
    AxisRule(r".*/word_embeddings/embeddings", ("vocab", "embed")),
    AxisRule(r".*/position_embedding/embeddings", (None, "embed")),
    AxisRule(r".*/type_embeddings/embeddings", (None, "embed")),
    AxisRule(r".*/embeddings/layer_norm/(gamma|beta)", ("embed",)),
    AxisRule(r".*/self_attention/(query|key|value)/kernel", ("embed", "heads", "kv")),
    AxisRule(r".*/self_attention/(query|key|value)/bias", ("heads", "kv")),
    AxisRule(r".*/self_attention/attention_output/kernel", ("heads", "kv", "embed")),
    AxisRule(r".*/self_attention/attention_output/bias", ("embed",)),
    AxisRule(r".*/(self_attention_layer_norm|output_layer_norm)/(gamma|beta)", ("embed",)),
    AxisRule(r".*/intermediate/kernel", ("embed", "mlp")),
    AxisRule(r".*/intermediate/bias", ("mlp",)),
    AxisRule(r".*/layer_\d+/output/kernel", ("mlp", "embed")),
    AxisRule(r".*/layer_\d+/output/bias", ("embed",)),
    # The pooler and the NSP classifier are small and stay replicated (both are frozen
    # without NSP, and a frozen weight is not gathered where used under `2d`).
    AxisRule(r".*/(pooler_transform|next_sentence)/kernel", (None, None)),
    AxisRule(r".*/(pooler_transform|next_sentence)/bias", (None,)),
    AxisRule(r".*/masked_lm/transform/dense/kernel", ("embed", None)),
    AxisRule(r".*/masked_lm/transform/dense/bias", (None,)),
    AxisRule(r".*/masked_lm/transform/LayerNorm/(gamma|beta)", (None,)),
    AxisRule(r".*/masked_lm/output_bias/bias", ("vocab",)),
)


class MaskedLMHead(mg_layers.MaskedLM):
    """Model Garden's MaskedLM, gathering the masked positions with a one-hot einsum.

    The tied embedding table is passed at call time rather than held, so the word
    embedding has one owner (the encoder) and DTensor places it once.

    Args:
      vocab_size, hidden_size: shape of the tied embedding table.
      activation: of the transform dense layer (BERT: gelu).
      initializer: of the transform dense layer.
    """

    def __init__(self, vocab_size: int, hidden_size: int, activation, initializer, name: str = "masked_lm"):
        # MaskedLM.build reads only the table's shape.
        super().__init__(embedding_table=tf.TensorSpec([vocab_size, hidden_size]), activation=activation,
                         initializer=initializer, output="logits", name=name)

    def call(self, sequence, masked_positions, embedding_table):
        """sequence [batch, length, hidden], positions [batch, predictions] -> logits [batch, predictions, vocab];
        with masked_positions None the head at every position: logits [batch, length, vocab]."""
        if masked_positions is None:
            return self.head(sequence, embedding_table)
        select = tf.one_hot(masked_positions, sequence.shape[1], dtype=sequence.dtype)  # [b, p, l]
        return self.head(tf.einsum("bpl,blh->bph", select, sequence), embedding_table)  # of [b, p, hidden]

    def head(self, x, embedding_table):
        """The head (transform dense, LayerNorm, tied output layer, bias) at every row of x [b, p, hidden]:
        float32 logits [b, p, vocab]."""
        x = self.layer_norm(self.dense(x))
        table = tf.cast(embedding_table, x.dtype)  # [vocab, hidden]
        logits = tf.einsum("bph,vh->bpv", x, table) + tf.cast(self.bias, x.dtype)  # [b, p, vocab]
        return tf.cast(logits, tf.float32)


class KeyMask(mg_layers.SelfAttentionMask):
    """BertEncoderV2's attention mask of input_mask [batch, length]: for blockwise attention
    [batch, 1, length], a key mask (every token, padding too, attends the example's real
    tokens: tfpod.attention.mask_segments), else Model Garden's [batch, length, length]."""

    def call(self, inputs, to_mask=None):
        if attention.current().segment_masks:
            return tf.expand_dims(tf.cast(to_mask, inputs.dtype), 1)
        return super().call(inputs, to_mask)


class BertPretrainer(tf_keras.Model):
    """BERT with its pretraining heads: batch features -> masked-LM logits [batch, predictions, vocab]."""

    def __init__(self, config: BertConfig, name: str = "bert"):
        super().__init__(name=name)
        self.config = config

        def init():  # a fresh initializer per layer, so no two weights share values
            return tf_keras.initializers.TruncatedNormal(stddev=config.init_stddev)

        activation = fused.activation(config.activation)
        self.encoder = mg_networks.BertEncoderV2(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            max_sequence_length=config.seq_len,
            type_vocab_size=config.type_vocab_size,
            inner_dim=config.intermediate_size,
            inner_activation=activation,
            output_dropout=config.dropout,
            attention_dropout=config.attention_dropout,
            initializer=init(),
            norm_first=config.norm_first,
            name="encoder",
        )
        # The encoder's own word embedding; `outputs_and_pooled` picks one-hot or gather lookups.
        # (Handing BertEncoderV2 an `embedding_layer` instead would also keep the layer in
        # its config dict, a path tf_keras's DTensor variable mapping cannot follow.)
        embedding = self.encoder.get_embedding_layer()
        if not isinstance(embedding, mg_layers.OnDeviceEmbedding):
            raise TypeError(f"BertEncoderV2's word embedding is a {type(embedding).__name__}, not an OnDeviceEmbedding")
        # Its TransformerEncoderBlocks, replaced (before they are built) by the same post-norm
        # blocks written as 2-D matmuls (gpt.Block: same weights, names and math).
        if len(compat.transformer_layers(self.encoder)) != config.num_layers:
            raise TypeError(f"BertEncoderV2 has {len(compat.transformer_layers(self.encoder))} blocks, not {config.num_layers}")
        shape = gpt.GPTConfig(
            vocab_size=config.vocab_size, seq_len=config.seq_len, num_layers=config.num_layers,
            embed_dim=config.hidden_size, num_heads=config.num_heads, mlp_dim=config.intermediate_size,
            dropout=config.dropout, attention_dropout=config.attention_dropout, norm_epsilon=NORM_EPSILON)
        compat.set_transformer_layers(self.encoder, [
            gpt.Block(shape, init, norm_first=config.norm_first, activation=activation, name=f"transformer/layer_{i}")
            for i in range(config.num_layers)])
        for layer in compat.flatten_layers(self.encoder):  # its attention mask: a key mask for blockwise attention
            if type(layer) is mg_layers.SelfAttentionMask:
                layer.__class__ = KeyMask
        self.encoder.pooler_layer.trainable = config.next_sentence
        self.masked_lm = MaskedLMHead(config.vocab_size, config.hidden_size, activation, init())
        # The NSP classifier exists either way (so checkpoints have one shape), frozen without NSP.
        self.next_sentence = tf_keras.layers.Dense(2, kernel_initializer=init(), name="next_sentence")
        self.next_sentence.trainable = config.next_sentence

    def call(self, inputs, training=None, with_next_sentence=False):
        """Masked-LM logits [batch, predictions, vocab] (float32).

        With `with_next_sentence` (and config.next_sentence): (masked-LM logits,
        next-sentence logits [batch, 2]).
        """
        mlm_logits, pooled = self.outputs_and_pooled(inputs, training)
        nsp_logits = tf.cast(self.next_sentence(pooled), tf.float32)  # [batch, 2] (built even when unused)
        if not with_next_sentence:
            return mlm_logits
        return mlm_logits, (nsp_logits if self.config.next_sentence else None)

    def outputs_and_pooled(self, inputs, training=None):
        """(masked-LM logits [batch, predictions, vocab] float32, pooled [CLS] output [batch, hidden])."""
        return self._mlm_and_pooled(self.sequence_output(inputs, training), inputs)

    def _mlm_and_pooled(self, sequence, inputs) -> tuple:
        """(masked-LM logits, pooled [CLS] output [batch, hidden]) of the annotated last block output."""
        mlm_logits = self.masked_lm(sequence, inputs["masked_lm_positions"], self.encoder.get_embedding_table())
        # The encoder's pooler applied to the annotated sequence (the encoder's own pooled
        # output, computed from the unannotated one, is left unused).
        return mlm_logits, self.encoder.pooler_layer(sequence[:, 0, :])

    def sequence_logits(self, inputs, training=None) -> tf.Tensor:
        """The masked-LM head at every position: float32 logits [batch, length, vocab] of
        input_ids, input_mask and segment_ids (Hugging Face BertForPreTraining's prediction_logits)."""
        return self.masked_lm(self.sequence_output(inputs, training), None, self.encoder.get_embedding_table())

    def sequence_output(self, inputs, training=None) -> tf.Tensor:
        """The encoder's last block output [batch, length, hidden], annotated for the heads."""
        gpt.choose_lookup(self.encoder.get_embedding_layer())
        outputs = self.encoder(
            {"input_word_ids": inputs["input_ids"], "input_mask": inputs["input_mask"],
             "input_type_ids": inputs["segment_ids"]},
            training=training,
        )
        return shard(outputs["sequence_output"], ("batch", "length", "embed"))

    # -- the pieces a pipeline runs (staged) ------------------------------------------

    def embed_inputs(self, inputs, training) -> tf.Tensor:
        """The first block's input [batch, length, hidden], as the encoder makes it."""
        gpt.choose_lookup(self.encoder.get_embedding_layer())
        x = compat.encoder_embeddings(self.encoder, inputs["input_ids"], inputs["segment_ids"], training)
        return shard(x, gpt.ACTIVATION_AXES)

    def attention_mask(self, inputs) -> tf.Tensor:
        """[batch, length, length]: every token attends to the example's real tokens."""
        like = tf.zeros(inputs["input_mask"].shape, self.compute_dtype)  # the mask layer reads shape and dtype
        return compat.encoder_attention_mask(self.encoder, like, inputs["input_mask"])

    def block_and_aux(self, block, x, mask, training):
        """One encoder block: (x, no loss term of its own)."""
        return block([x, mask], training=training), None

    def heads(self, x, inputs) -> tuple:
        """(masked-LM logits, next-sentence logits or None) of the last block's output."""
        mlm_logits, pooled = self._mlm_and_pooled(shard(x, ("batch", "length", "embed")), inputs)
        return mlm_logits, (tf.cast(self.next_sentence(pooled), tf.float32) if self.config.next_sentence else None)


MODEL_FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions")


def input_signature(config: BertConfig) -> dict:
    length, predictions = config.seq_len, config.max_predictions
    return {
        "input_ids": tf.TensorSpec([None, length], tf.int32, name="input_ids"),
        "input_mask": tf.TensorSpec([None, length], tf.int32, name="input_mask"),
        "segment_ids": tf.TensorSpec([None, length], tf.int32, name="segment_ids"),
        "masked_lm_positions": tf.TensorSpec([None, predictions], tf.int32, name="masked_lm_positions"),
    }


def model_inputs(batch: dict) -> dict:
    """The features the model reads."""
    return {k: batch[k] for k in MODEL_FEATURES}


def batch_axes() -> dict:
    """Logical axes of each batch feature (the input feed shards `batch`)."""
    sequence, predictions = ("batch", "length"), ("batch", None)
    return {
        "input_ids": sequence, "input_mask": sequence, "segment_ids": sequence,
        "masked_lm_positions": predictions, "masked_lm_ids": predictions, "masked_lm_weights": predictions,
        "next_sentence_labels": ("batch",),
    }


def synthetic_batch(config: BertConfig, batch_size: int, rng: np.random.Generator) -> dict:
    """Random masked-LM examples of the experiment's shapes (train.synthetic_data=True).

    Each row is a noisy repeating pattern of ids (so a masked token can be inferred from
    its context) between [CLS] and [SEP], with a random-length padded tail, two segments,
    max_predictions distinct masked positions ([MASK] in the input) of which a random
    number are real, and a random next-sentence label.
    """
    length, predictions, vocab = config.seq_len, config.max_predictions, config.vocab_size
    first = min(bert_data.FIRST_PIECE, vocab - 1)  # ids below are special tokens
    period = 7
    base = rng.integers(first, vocab, size=(batch_size, period))
    ids = np.tile(base, (1, length // period + 1))[:, :length]
    noise = rng.random(ids.shape) < 0.1
    ids = np.where(noise, rng.integers(first, vocab, size=ids.shape), ids)
    lengths = rng.integers(max(3, length // 2), length + 1, size=batch_size)  # [CLS] ... [SEP] per row
    position = np.arange(length)[None, :]
    input_mask = (position < lengths[:, None]).astype(np.int32)
    ids[:, 0] = min(bert_data.CLS_ID, vocab - 1)
    ids[np.arange(batch_size), lengths - 1] = min(bert_data.SEP_ID, vocab - 1)
    ids = np.where(input_mask > 0, ids, 0)
    segment_ids = ((position >= lengths[:, None] // 2) & (input_mask > 0)).astype(np.int32)
    masked_positions = np.zeros((batch_size, predictions), np.int32)
    masked_ids = np.zeros((batch_size, predictions), np.int32)
    weights = np.zeros((batch_size, predictions), np.float32)
    inputs = ids.copy()
    for row in range(batch_size):
        candidates = np.arange(1, lengths[row] - 1)
        n = min(predictions, len(candidates), int(rng.integers(1, predictions + 1)))
        chosen = np.sort(rng.choice(candidates, size=n, replace=False))
        masked_positions[row, :n] = chosen
        masked_ids[row, :n] = ids[row, chosen]
        weights[row, :n] = 1.0
        inputs[row, chosen] = min(bert_data.MASK_ID, vocab - 1)
    return {
        "input_ids": inputs.astype(np.int32),
        "input_mask": input_mask,
        "segment_ids": segment_ids,
        "masked_lm_positions": masked_positions,
        "masked_lm_ids": masked_ids,
        "masked_lm_weights": weights,
        "next_sentence_labels": rng.integers(0, 2, size=batch_size).astype(np.int32),
    }


def _cross_entropy(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Per-position cross entropy, logsumexp minus the label's logit (picked with a one-hot
    product), so vocab-sharded logits reduce with all-reduces instead of being gathered."""
    label_logit = tf.reduce_sum(logits * tf.one_hot(labels, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return tf.reduce_logsumexp(logits, axis=-1) - label_logit


def loss_terms(model: BertPretrainer, batch: dict, training: bool) -> LossTerms:
    """Masked-LM cross entropy averaged over the real predictions of the global batch,
    plus the next-sentence cross entropy averaged over examples (0 without next_sentence),
    as Google's run_pretraining.py.

    Returns:
      LossTerms [masked-LM sum, next-sentence sum] with metrics {"loss_sum", "weight_sum",
      "masked_lm_loss", "next_sentence_loss"} (this batch's; float32 scalars):
      loss_sum / weight_sum is the masked-LM loss.
    """
    mlm_logits, nsp_logits = model(model_inputs(batch), training=training, with_next_sentence=True)
    sums, counts = loss_sums(mlm_logits, nsp_logits, batch), loss_counts(batch)
    metrics = {"loss_sum": sums[0], "weight_sum": counts[0], "masked_lm_loss": sums[0] / tf.maximum(counts[0], 1.0),
               "next_sentence_loss": sums[1] / tf.maximum(counts[1], 1.0)}
    return LossTerms(sums, metrics=metrics)


def loss_sums(mlm_logits, nsp_logits, batch: dict) -> list:
    """The summed pretraining losses: masked LM over the real predictions, then next sentence
    over the examples (0 without NSP logits); each is averaged over its `loss_counts`."""
    weights = tf.cast(batch["masked_lm_weights"], tf.float32)  # [batch, predictions]
    mlm = tf.reduce_sum(_cross_entropy(mlm_logits, batch["masked_lm_ids"]) * weights)
    if nsp_logits is None:
        return [mlm, tf.zeros_like(mlm)]
    labels = tf.reshape(tf.cast(batch["next_sentence_labels"], tf.int32), [-1])  # [batch]
    return [mlm, tf.reduce_sum(_cross_entropy(nsp_logits, labels))]


def loss_counts(batch: dict) -> list:
    """What each of `loss_sums` is averaged over: real predictions, then examples."""
    weights = tf.cast(batch["masked_lm_weights"], tf.float32)
    return [tf.reduce_sum(weights), tf.reduce_sum(tf.ones_like(weights[:, 0]))]


def staged(model: BertPretrainer) -> StagedModel:
    """BERT cut for pipeline stages: embeddings first, encoder blocks, the heads and loss last."""
    encoder = model.encoder
    return StagedModel(
        first=lambda batch, training: model.embed_inputs(batch, training),
        context=model.attention_mask,
        blocks=compat.transformer_layers(encoder),
        block=model.block_and_aux,
        outputs=lambda x, batch: model.heads(x, batch)[0],
        loss_sums=lambda x, batch, training: loss_sums(*model.heads(x, batch), batch),
        activation_axes=gpt.ACTIVATION_AXES,
        first_layers=compat.encoder_input_layers(encoder),
        last_layers=(encoder.pooler_layer, model.masked_lm, model.next_sentence),
    )


def weight_flops_per_token(config: BertConfig) -> float:
    """flops_per_token less the attention's scores and values: its weights' matmuls."""
    return flops_per_token(config) - 12.0 * config.num_layers * config.seq_len * config.hidden_size


def flops_per_token(config: BertConfig) -> float:
    """Model FLOPs per trained token (forward + backward, 6 per multiply-add weight).

    The encoder's matmuls (4 h^2 attention + 2 h i MLP per layer) and attention scores
    and values (12 * layers * length * h, as in the PaLM appendix) for every token; the
    masked-LM head (transform h^2 and the tied output layer vocab x h) for the
    max_predictions positions of a row, and the pooler and NSP classifier once per row,
    spread over the row's tokens.
    """
    h, layers, length = config.hidden_size, config.num_layers, config.seq_len
    encoder = 6.0 * layers * (4 * h * h + 2 * h * config.intermediate_size) + 12.0 * layers * length * h
    head = 6.0 * (h * h + config.vocab_size * h) * config.max_predictions / length
    nsp = 6.0 * (h * h + 2 * h) / length if config.next_sentence else 0.0
    return encoder + head + nsp


def serving(model: BertPretrainer, config: BertConfig, data_config) -> tuple[tf.Module, dict]:
    """BERT's SavedModel signatures (tfpod.export), on raw strings with [MASK] pieces and on token ids.

    A text is tokenized in the graph with the run's vocabulary, a SentencePiece model or a
    WordPiece vocab.txt (the [MASK] piece written in the text becomes the mask id), cut to seq_len - 2 pieces and framed as
    [CLS] text [SEP], one segment; the first max_predictions [MASK]s are predicted.

      serving_default(text string [batch]) ->
        predicted_ids int32 [batch, max_predictions]  the best piece at each [MASK]
          (0 past the last [MASK])
        predicted_tokens string [batch, max_predictions]  those pieces ("" past the last)
        num_masks int32 [batch]  [MASK]s predicted
        masked_lm_logits float32 [batch, max_predictions, vocab]
        pooled_output float32 [batch, hidden]  the encoder's pooled [CLS] embedding
      ids(input_ids, segment_ids, input_mask int32 [batch, length]) ->
        logits float32 [batch, length, vocab]  the masked-LM head at every position (Hugging
          Face BertForPreTraining's prediction_logits), for clients that tokenize
          themselves; length is at most seq_len

    Data read from create_pretraining_data.py records without a bert_data.vocab_path has no
    vocabulary to tokenize raw strings with: the export then has the `ids` signature alone,
    also as serving_default (TF Serving's default).
    """
    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name=n)
                                  for n in ("input_ids", "segment_ids", "input_mask")])
    def ids_signature(input_ids, segment_ids, input_mask):
        inputs = {"input_ids": input_ids, "segment_ids": segment_ids, "input_mask": input_mask}
        limits = {"input_ids": (config.vocab_size, "vocab_size of the model"),
                  "segment_ids": (config.type_vocab_size, "type_vocab_size of the model"),
                  "input_mask": (2, "1 for a token, 0 for padding")}
        with tf.control_dependencies(lm_serving.id_checks(inputs, limits, config.seq_len)):
            return {"logits": model.sequence_logits({k: tf.identity(v) for k, v in inputs.items()}, training=False)}

    module = tf.Module()
    module.model = model
    by_ids = ids_signature.get_concrete_function()
    if not data_config.masked_online and not data_config.vocab_path:  # records, no vocabulary for raw strings
        return module, {"serving_default": by_ids, "ids": by_ids}

    from tfpod.input import lm_data, text as text_lib

    vocab_path = data_config.vocab_path or lm_data.resolve(lm_data.LMDataConfig(
        vocab_size=data_config.vocab_size, data_dir=data_config.data_dir)).vocab_path
    tokenizer = text_lib.load_tokenizer(vocab_path, lower_case=data_config.lower_case)
    pieces = int(tokenizer.vocab_size())
    if pieces > config.vocab_size:  # raw text would become ids the model does not have
        raise UserError(f"export: the vocabulary {vocab_path} has {pieces} pieces but the model has bert.vocab_size="
                        f"{config.vocab_size}: set bert_data.vocab_path to the model's own vocabulary (or "
                        "bert_data.format='records' to export the ids signature alone)")
    ids = bert_data.special_ids(tokenizer, vocab_path)
    module.tokenizer = tokenizer
    length, predictions = config.seq_len, config.max_predictions

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def serving_default(texts):
        rows = tf.shape(texts)[0]
        pieces = tokenizer.tokenize(texts)[:, : length - 2]  # ragged [batch, pieces]
        cls = tf.RaggedTensor.from_tensor(tf.fill([rows, 1], ids["cls"]))
        sep = tf.RaggedTensor.from_tensor(tf.fill([rows, 1], ids["sep"]))
        tokens = tf.concat([cls, pieces, sep], axis=1)
        input_ids = tokens.to_tensor(0, shape=[None, length])  # [batch, length]
        input_mask = tf.cast(tf.sequence_mask(tokens.row_lengths(), length), tf.int32)
        is_mask = tf.equal(input_ids, ids["mask"])
        rank = tf.cumsum(tf.cast(is_mask, tf.int32), axis=1) - 1  # [batch, length]: which [MASK] it is
        slot = tf.one_hot(tf.where(is_mask & (rank < predictions), rank, -1), predictions, dtype=tf.int32)
        positions = tf.einsum("blp,l->bp", slot, tf.range(length))  # [batch, predictions], 0 where none
        weights = tf.reduce_sum(slot, axis=1)  # [batch, predictions]: 1 for a real [MASK]
        logits, pooled = model.outputs_and_pooled(
            {"input_ids": input_ids, "input_mask": input_mask, "segment_ids": tf.zeros_like(input_ids),
             "masked_lm_positions": positions}, training=False)
        best = tf.argmax(logits, axis=-1, output_type=tf.int32) * weights
        return {
            "predicted_ids": best,
            "predicted_tokens": tf.where(weights > 0, tokenizer.id_to_string(best), ""),
            "num_masks": tf.reduce_sum(weights, axis=1),
            "masked_lm_logits": logits,
            "pooled_output": tf.cast(pooled, tf.float32),
        }

    return module, {"serving_default": serving_default.get_concrete_function(), "ids": by_ids}


class BertTask(Task):
    """BERT pretraining (masked LM, optional next sentence): gin `bert.*`, data `bert_data.*`."""

    name = "bert"
    config_class = BertConfig
    data_name = "bert_data"
    data_config_class = bert_data.BertDataConfig
    default_preset = "tensor"
    axis_rules = AXIS_RULES
    eval_metric = evaluation.MASKED_LM

    build = staticmethod(BertPretrainer)
    input_signature = staticmethod(input_signature)
    flops_per_token = staticmethod(flops_per_token)
    weight_flops_per_token = staticmethod(weight_flops_per_token)
    batch_axes = staticmethod(batch_axes)
    model_inputs = staticmethod(model_inputs)
    synthetic_batch = staticmethod(synthetic_batch)
    make_input = staticmethod(bert_data.bert_input)
    loss_terms = staticmethod(loss_terms)
    loss_counts = staticmethod(loss_counts)
    serving = staticmethod(serving)
    plan_profile = staticmethod(functools.partial(plan_profiles.bert, flops=flops_per_token))
    staged = staticmethod(staged)
    pipelines = skips_corrupt = serves = True

    def tokens_per_example(self, config: BertConfig) -> int:
        return config.seq_len


TASK = BertTask()
