"""The LM's SavedModel signatures (gpt, moe, llama; tfpod.export): raw strings and token ids.

`id_checks` guards any signature on token ids (BERT's `ids` too): one readable line for
a row longer than the position table, ids outside the vocabulary, or mismatched inputs.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tfpod.input import lm_data
from tfpod.models import decoding

# The generating signatures' options after the prompt (models/decoding.choose): each one value
# for every row (a scalar or [1]) or one per row ([batch]); shapes left open for both.
OPTIONS = tuple(tf.TensorSpec(None, dtype, name=name) for name, dtype in (
    ("max_new_tokens", tf.int32), ("temperature", tf.float32), ("top_k", tf.int32), ("top_p", tf.float32),
    ("seed", tf.int32)))
STOP = tf.TensorSpec(None, tf.string, name="stop")  # stop strings: "" for none (see stop_table)


def stop_table(stop: tf.Tensor, batch: tf.Tensor) -> tf.Tensor:
    """Stop strings string [batch, S] from a scalar (one for every row), [rows] (one per row:
    TF Serving's instances) or [rows, S] (several per row), rows 1 or the batch's."""
    rank = tf.rank(stop)
    table = tf.cond(rank >= 2, lambda: tf.reshape(stop, tf.concat([tf.shape(stop)[:1], [-1]], 0)),
                    lambda: tf.reshape(stop, [-1, 1]))
    rows = tf.shape(table)[0]
    check = tf.debugging.Assert((rank <= 2) & ((rows == 1) | (rows == batch)), [tf.strings.format(
        "stop has shape {} for {} rows: send a string for every row, one per row, or [rows, n] strings "
        "(empty strings for none)", [tf.shape(stop), batch])])
    with tf.control_dependencies([check]):
        return tf.broadcast_to(table, tf.stack([batch, tf.shape(table)[1]]))


def first_stop(texts: tf.Tensor, stops: tf.Tensor) -> tf.Tensor:
    """int32 [batch]: the byte offset in each text [batch] of the earliest occurrence of any of
    its non-empty stop strings [batch, S], -1 where none occurs (compared as bytes)."""
    lengths, stop_lengths = tf.strings.length(texts), tf.strings.length(stops)  # [batch], [batch, S]
    width = tf.maximum(tf.reduce_max(lengths), 1)
    most = tf.maximum(tf.reduce_max(stop_lengths), 1)
    text = tf.pad(tf.cast(tf.io.decode_raw(texts, tf.uint8, fixed_length=width), tf.int32), [[0, 0], [0, most]])
    windows = tf.gather(text, tf.range(width)[:, None] + tf.range(most)[None, :], axis=1)  # [batch, width, most]
    stop = tf.reshape(tf.cast(tf.io.decode_raw(tf.reshape(stops, [-1]), tf.uint8, fixed_length=most), tf.int32),
                      tf.stack([tf.shape(stops)[0], -1, most]))  # [batch, S, most]
    beyond = tf.range(most)[None, None, None, :] >= stop_lengths[:, :, None, None]
    match = tf.reduce_all(tf.equal(windows[:, None], stop[:, :, None]) | beyond, axis=-1)  # [batch, S, width]
    at = tf.range(width)[None, None, :]
    match &= (at + stop_lengths[:, :, None] <= lengths[:, None, None]) & (stop_lengths[:, :, None] > 0)
    first = tf.reduce_min(tf.where(match, at, width), axis=[1, 2])
    return tf.where(first < width, first, -1)


def id_checks(inputs: dict, limits: dict, seq_len: int) -> list:
    """Assert ops on a serving signature's int32 [batch, length] inputs, each failing with one line
    (what, which input, how to fix): every input has the first one's shape, at most seq_len
    positions (the position table), and values in [0, limit).

    Args:
      inputs: {name: int32 [batch, length]}, in the signature's order.
      limits: {name: (limit, what it is, e.g. "vocab_size of the model")}: the input's values
        must be in [0, limit). (No quote marks in messages: the error escapes them.)
      seq_len: the size of the model's position table.

    Returns:
      The assert ops (run them with tf.control_dependencies before the model).
    """
    (first, ids), *others = inputs.items()
    length = tf.shape(ids)[1]
    checks = [tf.debugging.Assert(length <= seq_len, [tf.strings.format(
        f"{first} has {{}} positions, more than seq_len={seq_len}, the size of the model position table: "
        f"send at most {seq_len} per row", [length])])]
    for name, x in others:
        checks.append(tf.debugging.Assert(tf.reduce_all(tf.equal(tf.shape(x), tf.shape(ids))), [tf.strings.format(
            f"{name} has shape {{}} but {first} {{}}: send every input of the signature with one shape "
            "[batch, length]", [tf.shape(x), tf.shape(ids)])]))
    for name, (limit, what) in limits.items():
        x = inputs[name]
        low, high = tf.reduce_min(x), tf.reduce_max(x)
        checks.append(tf.debugging.Assert((low >= 0) & (high < limit), [tf.strings.format(
            f"{name} holds values from {{}} to {{}}, outside [0, {limit}) ({what}): send values in that range",
            [low, high])]))
    return checks


def serving(model, config, data_config, whole_sequences: bool = False) -> tuple[tf.Module, dict]:
    """The LM's SavedModel signatures (tfpod.export), on raw strings and on token ids.

    A prompt is tokenized in the graph (the run's SentencePiece model) after an EOS, the
    document boundary the LM saw in training, and only its last seq_len pieces are kept.

      serving_default(text string [batch]) ->
        logits float32 [batch, vocab]  the next token's logits after each prompt
        next_token_id int32 [batch], next_token string [batch]  its argmax and piece
      generate(text string [batch], max_new_tokens int32) ->
        ids int32 [batch, steps]  the greedy continuation, with a key/value cache
          (models/decoding.py; docs/generation.md); steps: the largest max_new_tokens
        text string [batch]  the continuation decoded, up to its EOS or first stop string
        num_tokens int32 [batch], log_probs float32 [batch, steps]
      sample(text, max_new_tokens, temperature, top_k, top_p, seed, stop string) -> as generate
      generate_ids(input_ids [batch, width], lengths [batch], max_new_tokens, temperature,
        top_k, top_p, seed) -> ids, num_tokens, log_probs (also without a vocabulary)
      Each option is one value for every row or one per row (OPTIONS, stop_table).
      ids(input_ids int32 [batch, length]) ->
        logits float32 [batch, length, vocab]  each position's next-token logits, for
          clients that tokenize themselves; length is at most seq_len, and (the model
          being causal) right padding leaves the earlier positions' logits unchanged

    With pre-tokenized data (lm_data.format='ids': no SentencePiece vocabulary) the export
    has `ids`, also as serving_default (TF Serving's default), and `generate_ids`.

    With `whole_sequences` (MoE: its routing groups are slices of seq_len tokens) the
    logits signatures run the model on ids right-padded with 0 to seq_len, and cut its
    logits back to the ids' length; its routing (not causal) then sees the padding. Its
    generation decodes each token as a routing group of its own (moe.MoEMLP).
    """
    seq_len = config.seq_len
    module = tf.Module()
    module.model = model
    logits_of = functools.partial(_logits, model, seq_len, whole_sequences)
    ids = _ids_signature(logits_of, config).get_concrete_function()
    tokenizer = None
    if data_config.format not in ("ids", "rows"):  # else pre-tokenized data: no vocabulary to tokenize with
        from tfpod.input import text as text_lib

        tokenizer = module.tokenizer = text_lib.load_tokenizer(lm_data.resolve(data_config).vocab_path)
    cached = _cached_generate(model, config, data_config.eos, tokenizer)
    signatures = {"serving_default": ids, "ids": ids, "generate_ids": _generate_ids(cached, config).get_concrete_function()}
    if tokenizer is None:
        return module, signatures
    return module, {**signatures, **_text_signatures(logits_of, cached, tokenizer, data_config, seq_len)}


def _logits(model, seq_len: int, whole_sequences: bool, ids: tf.Tensor) -> tf.Tensor:
    """The model's logits [batch, length, vocab] of ids [batch, length <= seq_len]."""
    if not whole_sequences:
        return model({"inputs": ids}, training=False)
    length = tf.shape(ids)[1]
    padded = tf.ensure_shape(tf.pad(ids, [[0, 0], [0, seq_len - length]]), [None, seq_len])  # [batch, seq_len]
    return model({"inputs": padded}, training=False)[:, :length]


def _ids_signature(logits_of, config):
    """`ids`: input_ids [batch, length] -> logits [batch, length, vocab], the ids checked."""

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name="input_ids")])
    def ids_signature(input_ids):
        with tf.control_dependencies(id_checks({"input_ids": input_ids},
                                               {"input_ids": (config.vocab_size, "vocab_size of the model")},
                                               config.seq_len)):
            return {"logits": logits_of(tf.identity(input_ids))}

    return ids_signature


def _detokenized(tokenizer, ids: tf.Tensor, lengths: tf.Tensor) -> tf.Tensor:
    """The text [batch] of each row's first `lengths` ids [batch, n]."""
    return tokenizer.detokenize(tf.RaggedTensor.from_tensor(ids, lengths=lengths))


def _cached_generate(model, config, eos: int, tokenizer):
    """The one generating function every generating signature calls (traced once):
    decoding.generate on prompts given right-padded [batch, P] with their lengths and stop
    strings [batch, S] (stop_table's); generation stops at `eos`, the run's end of document."""
    seq_len = config.seq_len

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32),
                                  *OPTIONS, tf.TensorSpec([None, None], tf.string)])
    def cached_generate(right_padded, lengths, max_new_tokens, temperature, top_k, top_p, seed, stops):
        batch, prompt = tf.shape(right_padded)[0], tf.shape(right_padded)[1]
        limit = decoding.per_row(max_new_tokens, batch, tf.int32, "max_new_tokens")
        worst = tf.argmax(lengths + limit)
        checks = [
            tf.debugging.Assert(tf.reduce_min(limit) >= 0, [tf.strings.format(
                "max_new_tokens is {}: send a number >= 0", [tf.reduce_min(limit)])]),
            tf.debugging.Assert(tf.reduce_min(lengths) >= 1, [
                "a prompt has no tokens: send at least one token (or text) per row"]),
            tf.debugging.Assert(lengths[worst] + limit[worst] <= seq_len, [tf.strings.format(
                f"a prompt of {{}} tokens plus max_new_tokens={{}} is more than the model context, seq_len={seq_len}: "
                "send a shorter prompt or fewer new tokens", [lengths[worst], limit[worst]])])]
        stopped = None
        if tokenizer is not None:
            any_stop = tf.reduce_any(tf.strings.length(stops) > 0)
            stopped = lambda out, count: tf.cond(
                any_stop, lambda: first_stop(_detokenized(tokenizer, out, count), stops) >= 0,
                lambda: tf.zeros([batch], tf.bool))
        with tf.control_dependencies(checks):
            # left padding: row i's tokens end at slot P - 1 (slot j reads j - (P - length))
            left = tf.gather(right_padded, (tf.range(prompt)[None, :] + lengths[:, None]) % prompt, batch_dims=1)
            return decoding.generate(model, left, lengths, limit, eos, temperature, top_k, top_p, seed,
                                     kv_heads=model.kv_heads(), stopped=stopped)

    return cached_generate


def _generate_ids(cached_generate, config):
    """`generate_ids`: ids in, ids out (clients that tokenize themselves; runs without a vocabulary)."""

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name="input_ids"),
                                  tf.TensorSpec([None], tf.int32, name="lengths"), *OPTIONS])
    def generate_ids(input_ids, lengths, max_new_tokens, temperature, top_k, top_p, seed):
        checks = id_checks({"input_ids": input_ids}, {"input_ids": (config.vocab_size, "vocab_size of the model")},
                           config.seq_len)
        checks.append(tf.debugging.Assert(
            tf.reduce_all((lengths >= 1) & (lengths <= tf.shape(input_ids)[1])) & tf.equal(
                tf.size(lengths), tf.shape(input_ids)[0]),
            ["lengths must give each row of input_ids its prompt length, 1 to the row's width: send one per row"]))
        with tf.control_dependencies(checks):
            return cached_generate(tf.identity(input_ids), lengths, max_new_tokens, temperature, top_k, top_p, seed,
                                   tf.fill([tf.shape(input_ids)[0], 1], ""))

    return generate_ids


def _text_signatures(logits_of, cached_generate, tokenizer, data_config, seq_len: int) -> dict:
    """The signatures on raw strings: serving_default (the next token), generate and sample."""
    from tfpod.input import text as text_lib

    start, eos = data_config.prompt_start, data_config.eos  # what documents start with (BOS, or after an EOS)

    def framed(texts):
        """Each prompt's ids, ragged [batch, pieces], after the run's start id."""
        return text_lib.frame(tf.cast(tokenizer.tokenize(texts), tf.int32), None, start)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def serving_default(texts):
        ids = framed(texts)[:, -seq_len:]
        logits = logits_of(ids.to_tensor(0))  # [batch, length, vocab]
        last = tf.gather(logits, tf.cast(ids.row_lengths(), tf.int32) - 1, batch_dims=1)  # [batch, vocab]
        next_id = tf.argmax(last, axis=-1, output_type=tf.int32)
        return {"logits": last, "next_token_id": next_id, "next_token": tokenizer.id_to_string(next_id)}

    def sample_texts(texts, *options):
        """cached_generate on text prompts, with the text of each continuation: up to (not
        including) its EOS, cut before its first stop string."""
        ids = framed(texts)
        stops = stop_table(options[-1], tf.shape(texts)[0])
        result = cached_generate(ids.to_tensor(0), tf.cast(ids.row_lengths(), tf.int32), *options[:-1], stops)
        before_eos = tf.reduce_sum(tf.cast(tf.equal(tf.cumsum(tf.cast(tf.equal(result["ids"], eos), tf.int32),
                                                              axis=1), 0), tf.int32), axis=1)
        text = _detokenized(tokenizer, result["ids"], tf.minimum(before_eos, result["num_tokens"]))
        cut = first_stop(text, stops)
        return {**result, "text": tf.strings.substr(text, tf.zeros_like(cut),
                                                     tf.where(cut >= 0, cut, tf.strings.length(text)))}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text"), OPTIONS[0]])
    def generate(texts, max_new_tokens):
        return sample_texts(texts, max_new_tokens, 0.0, 0, 1.0, 0, "")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text"), *OPTIONS, STOP])
    def sample(texts, max_new_tokens, temperature, top_k, top_p, seed, stop):
        return sample_texts(texts, max_new_tokens, temperature, top_k, top_p, seed, stop)

    return {"serving_default": serving_default.get_concrete_function(), "generate": generate.get_concrete_function(),
            "sample": sample.get_concrete_function()}


def recomputed_generate(logits_of, seq_len: int, ids: tf.RaggedTensor, max_new_tokens: tf.Tensor) -> tf.Tensor:
    """Greedy new tokens [batch, max_new_tokens] after each ragged prompt, the model run on
    each row's last seq_len tokens at every step (no cache: what `generate` ran before the
    cache, kept as the reference tests/test_generation.py and bench/generation.py compare with)."""
    rows = ids.nrows(out_type=tf.int32)
    lengths = tf.cast(ids.row_lengths(), tf.int32)  # [batch]
    buffer = tf.pad(ids.to_tensor(0), [[0, 0], [0, max_new_tokens]])  # [batch, total]
    total = tf.shape(buffer)[1]
    width = tf.minimum(seq_len, total)

    def step(i, buffer, lengths, out):
        start = tf.maximum(lengths - seq_len, 0)  # [batch]: the last seq_len tokens
        index = tf.minimum(start[:, None] + tf.range(width)[None, :], total - 1)
        logits = logits_of(tf.gather(buffer, index, batch_dims=1))
        last = tf.gather(logits, lengths - 1 - start, batch_dims=1)  # [batch, vocab]
        new = tf.argmax(last, axis=-1, output_type=tf.int32)
        buffer = tf.tensor_scatter_nd_update(buffer, tf.stack([tf.range(rows), lengths], axis=1), new)
        return i + 1, buffer, lengths + 1, out.write(i, new)

    out = tf.TensorArray(tf.int32, size=max_new_tokens, element_shape=[None])
    _, _, _, out = tf.while_loop(lambda i, *_: i < max_new_tokens, step, (tf.constant(0), buffer, lengths, out))
    return tf.reshape(tf.transpose(out.stack()), [rows, max_new_tokens])
