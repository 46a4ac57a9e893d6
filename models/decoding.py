"""Generation with a key/value cache: the prompt runs once, then one position per row a step.

    ids [batch, P] left-padded (each row's `lengths` real tokens end at slot P - 1)
      -> prefill: the model on all P slots, each layer's keys and values written to its
         cache [batch, kv heads, P + max_new_tokens, head dim] (slots 0 .. P - 1)
      -> tf.while_loop over new tokens: choose one per row from the last logits (greedy,
         or sampled with temperature / top-k / top-p and a seed, each row by its own
         options), then the model on that one slot (P + t), reading every cached slot a
         row may see and writing its own; a row stops at EOS, at its max_new_tokens or
         when `stopped` says so (stop strings), and the loop when every row has stopped

A row's positions count its own tokens (slot - its left padding), so learned and rotary
positions are those of the row run alone; padding slots are masked out of every query.
Attention reads the whole cache each step (its length is fixed for the loop), so a new
token costs the same at every step of a run.

A model decodes through `decode(ids, positions, caches)` (a gpt.DecoderLM): its
blocks' attention layers, handed a `LayerCache` where they take their mask, call
`LayerCache.attend(q, k, v)` with this call's queries, keys and values
[batch, heads, n, head dim] (keys and values rotated as the model does: Llama's rotary)
and use what it returns as their context.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf


@dataclasses.dataclass
class Slots:
    """What every layer's cache shares in one model call: where this call's n slots start
    (`start`, a scalar) and which slots hold a real token (`valid` [batch, slots], 1.0)."""

    start: tf.Tensor
    valid: tf.Tensor


@dataclasses.dataclass
class LayerCache:
    """One layer's keys and values [batch, kv heads, slots, head dim] (updated by `attend`)."""

    k: tf.Tensor
    v: tf.Tensor
    slots: Slots

    def attend(self, q: tf.Tensor, k: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
        """Writes k, v [batch, kv heads, n, d] at slots start .. start + n - 1 and returns
        the context [batch, heads, n, d] of q [batch, heads, n, d] over every slot each query
        may see (its own and earlier ones that hold a token). Query heads share key/value
        heads in groups (grouped-query attention) when there are fewer of the latter."""
        start = self.slots.start
        n = tf.shape(q)[2]
        self.k, self.v = (_write(cache, new, start) for cache, new in ((self.k, k), (self.v, v)))
        groups = q.shape[1] // self.k.shape[1]
        keys, values = self.k, self.v
        if groups > 1:
            keys, values = (tf.repeat(t, groups, axis=1) for t in (keys, values))
        slots = tf.shape(keys)[2]
        seen = tf.range(slots)[None, :] <= (start + tf.range(n))[:, None]  # [n, slots]: no later slot
        visible = tf.logical_and(seen[None], self.slots.valid[:, None, :] > 0)  # [batch, n, slots]
        scale = tf.cast(q.shape[-1] ** -0.5, q.dtype)
        scores = tf.cast(tf.matmul(q * scale, keys, transpose_b=True), tf.float32)  # [batch, heads, n, slots]
        scores = tf.where(visible[:, None], scores, -1e9)
        probs = tf.cast(tf.nn.softmax(scores, axis=-1), values.dtype)
        return tf.matmul(probs, values)  # [batch, heads, n, d]


def _write(cache: tf.Tensor, new: tf.Tensor, start: tf.Tensor) -> tf.Tensor:
    """cache [b, h, slots, d] with new [b, h, n, d] at slots start .. start + n - 1."""
    n = tf.shape(new)[2]
    every = 0b1011  # dimensions 0, 1 and 3 whole
    return tf.raw_ops.TensorStridedSliceUpdate(
        input=cache, begin=tf.stack([0, 0, start, 0]), end=tf.stack([0, 0, start + n, 0]),
        strides=tf.constant([1, 1, 1, 1]), value=tf.cast(new, cache.dtype), begin_mask=every, end_mask=every)


def per_row(x, batch: tf.Tensor, dtype: tf.DType, name: str) -> tf.Tensor:
    """An option [batch] from one value for every row (a scalar or [1]) or one per row."""
    x = tf.reshape(tf.cast(x, dtype), [-1])
    check = tf.debugging.Assert((tf.size(x) == 1) | (tf.size(x) == batch), [tf.strings.format(
        f"{name} has {{}} values for {{}} rows: send one value for every row or one per row", [tf.size(x), batch])])
    with tf.control_dependencies([check]):
        return tf.broadcast_to(x, tf.stack([batch]))


def _mix(x: tf.Tensor) -> tf.Tensor:
    """A bijection of uint32 with full avalanche (lowbias32, C. Wellons' hash prospector)."""
    shift, xor = tf.bitwise.right_shift, tf.bitwise.bitwise_xor
    x = xor(x, shift(x, tf.constant(16, tf.uint32))) * tf.constant(0x7FEB352D, tf.uint32)
    x = xor(x, shift(x, tf.constant(15, tf.uint32))) * tf.constant(0x846CA68B, tf.uint32)
    return xor(x, shift(x, tf.constant(16, tf.uint32)))


def uniforms(seed: tf.Tensor, step: tf.Tensor, n: tf.Tensor) -> tf.Tensor:
    """float32 [batch, n] in (0, 1), a function of each row's seed [batch], the step and
    the column alone (counter-based, as stateless random ops): a row's draws do not depend
    on the other rows of its batch."""
    xor = tf.bitwise.bitwise_xor
    seed = tf.bitcast(tf.cast(seed, tf.int32), tf.uint32)
    k1 = _mix(xor(seed, _mix(tf.bitcast(tf.cast(step, tf.int32), tf.uint32) + tf.constant(0x9E3779B9, tf.uint32))))
    k2 = _mix(xor(k1, tf.constant(0x85EBCA6B, tf.uint32)))
    bits = _mix(xor(_mix(k1[:, None] + tf.bitcast(tf.range(n), tf.uint32)[None, :]), k2[:, None]))  # [batch, n]
    return (tf.cast(tf.bitwise.right_shift(bits, tf.constant(8, tf.uint32)), tf.float32) + 0.5) * (2.0 ** -24)


def choose(logits: tf.Tensor, temperature: tf.Tensor, top_k: tf.Tensor, top_p: tf.Tensor, seed: tf.Tensor,
           step: tf.Tensor) -> tf.Tensor:
    """One token per row [batch] int32 from float32 logits [batch, vocab], each row by its
    own options ([batch] each): the argmax where temperature <= 0, else a draw from
    softmax(logits / temperature) restricted to the top_k most likely tokens (0: all), then
    to the smallest set of those whose probability reaches top_p (1.0: all; transformers'
    order). Draws are Gumbel-max on `uniforms(seed, step)`: the same seed, the same draw,
    whatever else is in the batch. Each filter runs only when a row asks for it (a sort of
    the vocabulary per step is not free)."""
    vocab = tf.shape(logits)[-1]

    def top_k_only(x):
        values = tf.math.top_k(x, tf.minimum(tf.reduce_max(top_k), vocab)).values  # [batch, k max]
        kth = tf.gather(values, tf.clip_by_value(top_k - 1, 0, tf.shape(values)[1] - 1), batch_dims=1)
        return tf.where((top_k[:, None] <= 0) | (x >= kth[:, None]), x, -1e9)

    def nucleus(x):
        ordered = tf.sort(x, axis=-1, direction="DESCENDING")  # [batch, vocab]
        before = tf.cumsum(tf.nn.softmax(ordered, axis=-1), axis=-1, exclusive=True)  # of the tokens ranked above
        floor = tf.reduce_min(tf.where(before < top_p[:, None], ordered, tf.float32.max), axis=-1, keepdims=True)
        return tf.where(x >= floor, x, -1e9)

    def sampled():
        x = logits / tf.where(temperature > 0, temperature, 1.0)[:, None]
        x = tf.cond(tf.reduce_any(top_k > 0), lambda: top_k_only(x), lambda: x)
        x = tf.cond(tf.reduce_any(top_p < 1.0), lambda: nucleus(x), lambda: x)
        gumbel = -tf.math.log(-tf.math.log(uniforms(seed, step, vocab)))
        return tf.argmax(x + gumbel, axis=-1, output_type=tf.int32)

    greedy = tf.argmax(logits, axis=-1, output_type=tf.int32)
    return tf.cond(tf.reduce_any(temperature > 0), lambda: tf.where(temperature > 0, sampled(), greedy),
                   lambda: greedy)


def generate(model, ids: tf.Tensor, lengths: tf.Tensor, max_new_tokens, eos_id: int, temperature=0.0, top_k=0,
             top_p=1.0, seed=0, kv_heads: int | None = None, stopped=None) -> dict:
    """New tokens after each left-padded prompt, with a key/value cache.

    Args:
      model: a model with `decode(ids, positions, caches)` and `config` (num_layers,
        num_heads, head size embed_dim / num_heads).
      ids: int32 [batch, P], each row's prompt right-aligned (left padding: any id).
      lengths: int32 [batch], each row's prompt length (1..P).
      max_new_tokens, temperature, top_k, top_p, seed: a value for every row or one per
        row ([batch]; see `choose`).
      eos_id: a row stops after generating it.
      kv_heads: key/value heads (grouped-query attention); None: the query heads.
      stopped: optional (ids [batch, steps] so far, num_tokens [batch]) -> bool [batch],
        rows that stop now (stop strings: lm_serving).

    Returns:
      {"ids": int32 [batch, max of max_new_tokens] (after a row's num_tokens: eos_id),
      "num_tokens": int32 [batch] (up to and including the token that stopped the row:
      EOS, a stop, or its max_new_tokens), "log_probs": float32 [batch, steps], each
      token's log-probability under the model (log-softmax of its logits; 0 after
      num_tokens)}. The loop ends when every row has stopped.
    """
    c = model.config
    batch, prompt = tf.shape(ids)[0], tf.shape(ids)[1]
    limit = per_row(max_new_tokens, batch, tf.int32, "max_new_tokens")
    temperature, top_p = (per_row(x, batch, tf.float32, n) for x, n in ((temperature, "temperature"), (top_p, "top_p")))
    top_k, seed = (per_row(x, batch, tf.int32, n) for x, n in ((top_k, "top_k"), (seed, "seed")))
    steps = tf.maximum(tf.reduce_max(limit), 0)
    slots = prompt + steps
    pad = prompt - lengths  # [batch]
    heads, d = kv_heads or c.num_heads, c.embed_dim // c.num_heads
    dtype = model.compute_dtype
    valid = tf.cast(tf.range(slots)[None, :] >= pad[:, None], tf.float32) * tf.cast(
        tf.range(slots)[None, :] < prompt, tf.float32)  # [batch, slots]: the prompt's tokens
    empty = tf.zeros(tf.stack([batch, heads, slots, d]), dtype)

    def run(tokens, start, valid, kv):
        shared = Slots(start, valid)
        caches = [LayerCache(k, v, shared) for k, v in kv]
        n = tf.shape(tokens)[1]
        positions = tf.maximum(start + tf.range(n)[None, :] - pad[:, None], 0)  # [batch, n]: each row's own
        logits = model.decode(tokens, positions, caches)  # [batch, n, vocab]
        return logits[:, -1], [(cache.k, cache.v) for cache in caches]

    last, kv = run(ids, tf.constant(0), valid, [(empty, empty) for _ in range(c.num_layers)])

    def step(t, last, valid, kv, done, count, out, log_probs):
        token = tf.where(done, eos_id, choose(last, temperature, top_k, top_p, seed, t))
        log_prob = tf.where(done, 0.0, tf.gather(tf.nn.log_softmax(last, axis=-1), token, batch_dims=1))
        column = tf.equal(tf.range(steps), t)[None, :]  # [1, steps]
        out = tf.where(column, token[:, None], out)
        log_probs = tf.where(column, log_prob[:, None], log_probs)
        count += tf.cast(~done, tf.int32)
        done = done | tf.equal(token, eos_id) | (count >= limit)
        if stopped is not None:
            done = done | stopped(out[:, :t + 1], count)
        slot = prompt + t
        valid = tf.maximum(valid, tf.cast(tf.equal(tf.range(slots), slot), tf.float32)[None, :])
        last, kv = tf.cond(tf.reduce_all(done), lambda: (last, kv), lambda: run(token[:, None], slot, valid, kv))
        return t + 1, last, valid, kv, done, count, out, log_probs

    loop = (tf.constant(0), last, valid, kv, limit <= 0, tf.zeros([batch], tf.int32),
            tf.fill(tf.stack([batch, steps]), tf.constant(eos_id, tf.int32)), tf.zeros(tf.stack([batch, steps])))
    _, _, _, _, _, count, out, log_probs = tf.while_loop(
        lambda t, last, valid, kv, done, *_: (t < steps) & ~tf.reduce_all(done), step, loop,
        shape_invariants=(tf.TensorShape([]), last.shape, tf.TensorShape([None, None]),
                          [(tf.TensorShape([None, heads, None, d]),) * 2 for _ in kv],
                          tf.TensorShape([None]), tf.TensorShape([None]), tf.TensorShape([None, None]),
                          tf.TensorShape([None, None])))
    return {"ids": out, "num_tokens": count, "log_probs": log_probs}
