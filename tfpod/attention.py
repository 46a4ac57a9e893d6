"""Attention that never holds the length x length matrix: queries and keys in blocks with an
online softmax (FlashAttention; Rabe and Staats), and a gradient that recomputes each block.

    out = softmax(q k^T / sqrt(d) + mask) v        q [batch, heads, Lq, d], k and v [batch, heads, Lk, d]

The mask is never a tensor of its own: a query may attend a key when their segment ids are
equal (packed documents; padding is a segment of its own, 0 by convention) and, with
`causal`, when the key's position is not after the query's. Each block's additive mask
(-1e9 where not allowed, as the materialized path's) is made from the block's positions and
segment ids.

Keys go in blocks of `block_size`; queries in a few groups (`QUERY_GROUPS` contiguous
groups of whole blocks, or under context parallelism each device's two chunks: see
`context_attention`). A (group, key block) pair wholly above the diagonal of a causal mask
is skipped, known from the group's static position bounds. Forward, per query group: a
running row max m and sum l over its key blocks,

    s = q_g k_j^T * scale + mask_gj;  m' = max(m, rowmax s);  p = exp(s - m')
    l = l * exp(m - m') + rowsum p;    acc = acc * exp(m - m') + dropout(p) v_j

and out_g = acc / l; only out and the row statistics m and l are kept. Backward,
per pair, with D = rowsum(dout * out) (which holds with dropout too):

    p = exp(s - m) / l;  dv_j += dropout(p)^T dout_g;  dp = dropout'(dout_g v_j^T)
    ds = p * (dp - D);  dq_g += ds k_j * scale;  dk_j += ds^T q_g * scale

Each pair starts after the previous one's results: the executor would otherwise make every
pair's scores and mask as soon as q and k exist and hold them until their turn (a whole
score matrix per head). The order is a data dependency, an exact zero read from the previous
pair's results and added to the pair's queries, positions and segment ids (`_after`):
control dependencies are not enough, as DTensor's graph passes drop those between
stateless ops. Without packing (segment ids [batch, 1]) only the pairs on a causal mask's
diagonal are masked. So memory is linear in the length (two pairs' [batch, heads, group
rows, block] temporaries at most), and so is the graph (at most
groups x key blocks pairs; a pair per query block and key block made a graph, and its
memory, quadratic in the length). With 4 groups a causal mask costs 5/8 of the whole
matrix's work (1/2 is the least; the materialized path skips 1/4 of it).

Dropout on the probabilities draws each pair's keep mask from a stateless seed and the
pair's indices, so the backward draws the same masks (`keep_mask`).

`materialized` is the same function with the whole [batch, heads, Lq, Lk] matrix (the path
tfpod used before; tests compare the two).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import tensorflow as tf

from tfpod import UserError, compat, fused
from tfpod.partitioning import context as partitioning_context, step_context
from tfpod.partitioning.step_context import shard

NEG = -1e9  # the additive mask where a query may not attend (as the materialized path's)
# implementation -> the masks its models pass it: "segments" (segment ids [batch, length] or key
# masks [batch, 1, S]: `mask_segments`) or "dense" ([batch, Lq, Lk]).
IMPLEMENTATIONS = {"blockwise": "segments", "materialized": "dense"}


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """gin: `attention.implementation` and `attention.block_size`.

    A run's is a field of its placement and so of each step's context (Placement.compile);
    `current()` reads it where a model's attention is traced, `using` sets it elsewhere.

    Attributes:
      implementation: "blockwise" (queries and keys in blocks, no length x length tensor in
        the forward or the backward) or "materialized" (the whole score matrix, kept for the
        backward: memory grows with the square of the sequence).
      block_size: queries and keys per block (blockwise). 512: at 1,024 tokens a causal
        mask is 3 blocks of 512 x 512, the work of the materialized path's two halves.
    """

    implementation: str = "blockwise"
    block_size: int = 512

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise UserError(f"attention.implementation={self.implementation!r}: use one of {', '.join(IMPLEMENTATIONS)}")
        if self.block_size < 1:
            raise UserError(f"attention.block_size={self.block_size} must be at least 1")

    @property
    def segment_masks(self) -> bool:
        """Whether models pass this attention segment ids or key masks (else dense masks)."""
        return IMPLEMENTATIONS[self.implementation] == "segments"


DEFAULT = AttentionConfig()


def current() -> AttentionConfig:
    """The attention the model being traced runs: its step context's (the placement's, opened
    by `Placement.compile`; or `using`'s), or the defaults outside any context (plain Keras)."""
    context = step_context.current_context()
    return DEFAULT if context is None or context.attention is None else context.attention


def using(config: AttentionConfig | None) -> contextlib.AbstractContextManager:
    """A block of a trace whose attention is `config` (None: the defaults): a step context
    without a mesh outside a step (single-device export and serving, Keras's fit, the
    planner's build), or the enclosing step's context with it."""
    return step_context.tracing(attention=config)


def self_attention_mask(ids: tf.Tensor, segment_ids: tf.Tensor | None, dense) -> tf.Tensor:
    """What a model's blocks pass their attention for the mask: segment ids [batch, length]
    for blockwise attention ([batch, 1] without packing: one segment, no segment mask), else
    `dense(ids, segment_ids)`, the [batch, length, length] mask."""
    if current().segment_masks:
        if segment_ids is None:
            return tf.ones(tf.stack([tf.shape(ids)[0], 1]), tf.int32)
        return tf.cast(segment_ids, tf.int32)
    return dense(ids, segment_ids)


def block_for(length: int, causal: bool) -> int:
    """The key block a self-attention over `length` tokens runs with: attention.block_size,
    and under a causal mask over an even length at most half of it (two blocks at least:
    the mask then skips a quarter)."""
    size = current().block_size
    if causal and length and length % 2 == 0:
        size = min(size, length // 2)
    return size


def dropout_seed(dropout) -> tf.Tensor | None:
    """The [2] int64 stateless seed a Keras dropout layer would draw its next mask from, or
    None (a layer without a stateless seed: Keras's legacy stateful dropout).

    Under tfpod's trainer (tfpod.partitioning.replayable_dropout) this is (train.seed, layer,
    microbatch, step): a resumed run and a recomputed block draw the same masks."""
    seed = compat.stateless_seed(dropout)
    return None if seed is None else tf.cast(tf.stack(seed), tf.int64)


def _dropping(dropout, training) -> bool | None:
    """Whether `dropout` (a Keras layer or None) drops now: True, False, or None when `training`
    is only known when the step runs (a tensor)."""
    if dropout is None or not dropout.rate or training is None:
        return False
    value = tf.get_static_value(training)
    return None if value is None else bool(value)


def mask_segments(mask: tf.Tensor, lq: int | None):
    """(query segment ids [batch, Lq], key segment ids [batch, Lk]) of a mask `attend` takes, or
    None for a dense mask: segment ids [batch, length] are both ([batch, 1]: one segment, (None,
    None)); a key mask [batch, 1, Lk] (1 where every query may attend the key: padding) gives
    keys its 1s and 0s and every query 1."""
    if mask.shape.rank == 2:
        if mask.shape[1] == 1:
            return None, None
        ids = tf.cast(mask, tf.int32)
        return ids, ids
    if mask.shape.rank == 3 and mask.shape[1] == 1 and lq is not None:
        keys = tf.cast(tf.squeeze(mask, 1), tf.int32)  # [batch, Lk]
        return tf.ones(tf.stack([tf.shape(mask)[0], lq]), tf.int32), keys
    return None


@tf.autograph.experimental.do_not_convert
def attend(q, k, v, mask, causal: bool, dropout=None, training=None) -> tf.Tensor:
    """Attention of q [batch, heads, Lq, d] over k, v [batch, heads, Lk, d] under `mask`:
    segment ids [batch, length] (`self_attention_mask`) or a key mask [batch, 1, Lk]
    (`mask_segments`): blockwise, with a causal mask if `causal`; or a dense [batch, Lq, Lk]
    mask (1 where a query may attend a key): materialized. A Keras `dropout` layer active in
    training drops the probabilities: in the kernel, from the layer's stateless seed
    (`dropout_seed`)."""
    segments = mask_segments(mask, q.shape[2])
    if segments is None:
        bias = (1.0 - tf.cast(tf.expand_dims(mask, 1), q.dtype)) * tf.cast(NEG, q.dtype)  # [batch, 1, Lq, Lk]
        if _dropping(dropout, training) is False:
            return fused.attention(q, k, v, bias, causal=causal)
        return _materialized_dropout(q, k, v, bias, dropout, training)
    return attend_segments(q, k, v, *segments, causal, dropout, training)


@tf.autograph.experimental.do_not_convert
def attend_segments(q, k, v, q_segments, k_segments, causal: bool, dropout=None, training=None) -> tf.Tensor:
    """Attention of q [batch, heads, Lq, d] over k, v [batch, heads, Lk, d]: a query attends a
    key of its own segment (ids [batch, Lq] and [batch, Lk], or None: one segment) and, with
    `causal`, not after its position (both from 0). Blockwise, with the run's block size and
    dropout in the kernel; materialized where it cannot be: a length unknown when traced (a
    SavedModel's prompt), `training` a tensor, or a dropout layer without a stateless seed."""
    dropping = _dropping(dropout, training)
    seed = dropout_seed(dropout) if dropping else None
    lq, lk = q.shape[2], k.shape[2]
    chunks = partitioning_context.context_chunks()
    if chunks > 1:  # the sequence split over `context`
        if dropping or lq != lk or q_segments is not k_segments:
            raise UserError("a `context` mesh axis needs a decoder's self-attention (segment ids, causal: gpt, llama) "
                            "without attention dropout (set the model's attention_dropout=0.0), not padding masks or "
                            "cross-attention (bert, transformer): use a mesh without `context`")
        return context_attention(q, k, v, q_segments, causal, chunks, current().block_size)
    if lq is not None and lk is not None and dropping is not None and (seed is not None or not dropping):
        size = block_for(lq, causal) if lq == lk else current().block_size
        return blockwise(q, k, v, q_segments, k_segments, causal, size, dropout.rate if dropping else 0.0, seed)
    bias = mask_bias(q_segments, k_segments, tf.range(tf.shape(q)[2]), tf.range(tf.shape(k)[2]), causal, tf.float32)
    bias = tf.zeros([1, 1, 1, 1], q.dtype) if bias is None else tf.cast(bias, q.dtype)
    if dropping is False:
        return fused.attention(q, k, v, bias, causal=causal)
    return _materialized_dropout(q, k, v, bias, dropout, training)


def _materialized_dropout(q, k, v, bias, dropout, training) -> tf.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v with the Keras `dropout` layer on the probabilities."""
    scores = tf.matmul(q * tf.cast(q.shape[-1] ** -0.5, q.dtype), k, transpose_b=True) + bias
    return tf.matmul(dropout(tf.nn.softmax(scores, axis=-1), training=training), v)



def mask_bias(q_segments, k_segments, q_positions, k_positions, causal: bool, dtype) -> tf.Tensor | None:
    """The additive mask [batch or 1, 1, *rows, lk] of a block (None: every query attends every key).

    Args:
      q_segments, k_segments: [batch, *rows], [batch, lk] int segment ids, or None (one segment).
      q_positions, k_positions: [*rows], [lk] int positions (for `causal`).
    """
    # (tf.expand_dims, not x[:, None]: DTensor's layout pass for a strided slice that adds an axis fails)
    rows = q_positions.shape.rank
    if q_segments is not None:
        q_segments, k_segments = tf.expand_dims(q_segments, 1), _expand(k_segments, 1, rows + 1)
    bias = scores_bias(q_segments, k_segments, q_positions, k_positions, causal, dtype)
    return None if bias is None else _expand(bias, 0, rows + 3 - bias.shape.rank)


def _expand(x: tf.Tensor, axis: int, n: int) -> tf.Tensor:
    """x with n axes of size 1 inserted at `axis`."""
    for _ in range(n):
        x = tf.expand_dims(x, axis)
    return x


def scores_bias(q_segments, k_segments, q_positions, k_positions, causal: bool, dtype) -> tf.Tensor | None:
    """The additive mask (0 or NEG) of scores [..., rows, lk], from query-side tensors [..., rows]
    and key-side ones [..., lk] that broadcast against them (None: every query attends every key).

    Args:
      q_segments, k_segments: int segment ids, or None (one segment).
      q_positions, k_positions: int positions (for `causal`).
    """
    allowed = None
    if q_segments is not None:
        allowed = tf.equal(tf.expand_dims(q_segments, -1), k_segments)
    if causal:
        lower = tf.expand_dims(q_positions, -1) >= k_positions
        allowed = lower if allowed is None else tf.logical_and(allowed, lower)
    if allowed is None:
        return None
    return (1.0 - tf.cast(allowed, dtype)) * tf.constant(NEG, dtype)


def keep_mask(seed, shape, rate: float, block: tuple[int, int], dtype, zero=None) -> tf.Tensor:
    """The dropout scale of one block's probabilities: 0 where dropped, 1 / (1 - rate) where kept,
    drawn from `seed` ([2] int) and the pair's (query group, key block) indices.

    The draw is a counter-based hash of the seed, the block and each element's index in it
    (`_uniform`), not a random op: every device computes the values of the elements it holds,
    equal to one device's whatever the layout (DTensor seeds a sharded random op per device
    from its mesh coordinates, see tfpod.partitioning.dropout, whose `counter_uniform` draws
    Keras dropout masks alike), with no draw of a replicated whole. `zero`: see `_after`."""
    keep = _uniform(seed, shape, block, zero) >= rate
    return tf.cast(keep, dtype) * tf.cast(1.0 / (1.0 - rate), dtype)


def _fmix(x: tf.Tensor) -> tf.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection of uint32 that mixes every bit into every other)."""
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(shift, tf.uint32)))
        x = x * tf.constant(factor, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))


_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: the Weyl step between consecutive counters


def _uniform(seed, shape, block: tuple[int, int], zero=None) -> tf.Tensor:
    """Float32 uniforms in [0, 1) of `shape` [batch, heads, rows, cols]: element (b, h, r, c) is
    a hash of (seed, block, b * heads + h, r * cols + c) (each index below 2^32)."""
    seed = tf.cast(seed, tf.int64)
    words = [seed[0], tf.bitwise.right_shift(seed[0], 32), seed[1], tf.bitwise.right_shift(seed[1], 32)]
    key = tf.constant(_GOLDEN, tf.uint32)
    for word in [tf.cast(tf.bitwise.bitwise_and(w, 0xFFFFFFFF), tf.uint32) for w in words] + \
            [tf.constant(block[0], tf.uint32), tf.constant(block[1], tf.uint32)]:
        key = _fmix(tf.bitwise.bitwise_xor(key, word) + tf.constant(_GOLDEN, tf.uint32))
    b, h, rows, cols = (shape[i] for i in range(4))
    # (tf.reshape, not x[:, None]: a strided slice that adds an axis fails under DTensor)
    row = tf.reshape(tf.range(b), [-1, 1, 1, 1]) * h + tf.reshape(tf.range(h), [1, -1, 1, 1])  # [b, h, 1, 1]
    row_key = _fmix(tf.bitwise.bitwise_xor(key, _fmix(tf.cast(row, tf.uint32))))
    if zero is not None:  # [b, h, 1]: drawn after the tensor it was read from
        row_key = row_key + tf.cast(tf.expand_dims(zero, -1), tf.uint32)
    cell = tf.cast(tf.reshape(tf.range(rows), [-1, 1]), tf.uint32) * tf.cast(cols, tf.uint32) + \
        tf.cast(tf.reshape(tf.range(cols), [1, -1]), tf.uint32)  # [rows, cols]
    bits = _fmix(row_key + cell * tf.constant(_GOLDEN, tf.uint32))  # [b, h, rows, cols]
    return tf.cast(tf.bitwise.right_shift(bits, tf.constant(8, tf.uint32)), tf.float32) * (2.0 ** -24)



QUERY_GROUPS = 4  # query rows are taken in at most this many groups (see `blockwise`)


def _after(previous: tf.Tensor | None) -> tf.Tensor | None:
    """An exact int32 zero [batch, heads, *rows[:-1], 1] read from `previous` ([batch, heads,
    *rows, n]: the previous pair's running max, or in the gradient its probabilities): added
    to a pair's queries, positions and segment ids (and dout), it makes the pair's scores wait
    for the previous pair's, which can still overlap its last products. A control dependency
    would not: DTensor's graph passes keep those only between ops with side effects, and the
    executor then made every pair's scores and masks at once (a score matrix per head held).
    Nothing moves between devices: each reads the zero from the rows of `previous` it holds."""
    if previous is None:
        return None
    return tf.bitwise.bitwise_and(tf.cast(previous[..., :1, 0], tf.int32), 0)


def _blocks(length: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(size, length - start)) for start in range(0, length, size)]


def query_groups(length: int, block_size: int, groups: int = QUERY_GROUPS) -> list[tuple[int, int]]:
    """(start, size) of the contiguous query groups `blockwise` takes a sequence in: at most
    `groups`, whole blocks each where the length allows."""
    blocks = -(-length // block_size)
    per = -(-blocks // min(groups, blocks)) * block_size
    return _blocks(length, per)


@dataclasses.dataclass(frozen=True)
class Group:
    """Some query rows of attention: their positions (an int tensor broadcasting against the
    rows, e.g. [rows] or [chunks, rows]), segment ids ([batch, *rows] or None) and static
    bounds on their positions (`low` <= position < `high`: a key block wholly at or after
    `high` is skipped under a causal mask, one wholly below `low` needs no causal mask)."""
    positions: tf.Tensor
    segments: tf.Tensor | None
    low: int
    high: int


def block_attention(q, k, v, split, merge, groups, k_segments, causal: bool, block_size: int,
                    dropout_rate: float = 0.0, seed=None, k_offset: int = 0) -> tf.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, key block by key block, for queries taken in groups.

    Args:
      q: the queries; `split(q)` gives one [batch, heads, *rows, d] tensor per group, and
        `merge` of such a list (the output's, the gradient's) gives q's shape back.
      k, v: [batch, heads, Lk, d], static length; k_segments [batch, Lk] or None.
      groups: one `Group` per split piece (its rows' positions, segments and bounds).
      causal: a query attends no key at a later position; block_size: keys per block.
      dropout_rate, seed: dropout on the probabilities; `seed` a [2] int tensor.
      k_offset: the position of k's first row.

    Every (group, key block) pair that some query of the group may attend is one step of
    the online softmax (forward: `_online_softmax`) and of the recomputed gradient
    (backward: `_recomputed_gradient`); each pair's scores are made after the previous
    pair's results, so the executor holds one pair's temporaries at a time ([batch, heads,
    rows, block]), and the graph has at most len(groups) x key blocks pairs: memory and
    graph both linear in the length.
    """
    lk = k.shape[2]
    if lk is None:
        raise ValueError("blockwise attention needs static sequence lengths")
    if dropout_rate and seed is None:
        raise ValueError("blockwise attention with dropout needs a seed")
    pairs = _Pairs(k, k_segments, _blocks(lk, block_size), causal, k_offset, q.shape[-1] ** -0.5, dropout_rate, seed)

    @tf.custom_gradient
    def core(q, k, v):
        outs, stats = _online_softmax(pairs, q, v, split, groups)
        out = merge(outs)

        def grad(d_out):
            return _recomputed_gradient(pairs, q, k, v, split, merge, groups, outs, stats, d_out)

        return out, grad

    return core(q, k, v)


_MATMULS = {"bhqd,bhkd->bhqk": dict(transpose_b=True), "bhqk,bhkd->bhqd": {},
            "bhqk,bhqd->bhkd": dict(transpose_a=True)}


def _contract(equation_4d: str, a, b):
    """The einsum `equation_4d` of [batch, heads, rows, d]-like tensors; a group of
    [batch, heads, chunks, rows, d] (context parallelism) takes one more letter."""
    if a.shape.rank == 4 and b.shape.rank == 4:  # (a batched matmul: faster than einsum's on oneDNN)
        return tf.matmul(a, b, **_MATMULS[equation_4d])
    ins, out = equation_4d.split("->")
    x, y = ins.split(",")
    widen = lambda t, r: t if r == 4 else t[:2] + "c" + t[2:]
    out_rank = 5 if "q" in out else 4  # (a key block's gradient sums over the chunks)
    return tf.einsum(f"{widen(x, a.shape.rank)},{widen(y, b.shape.rank)}->{widen(out, out_rank)}", a, b)


def _ordered(x, zero):
    """x after the tensor `zero` was read from (`_after`)."""
    return x if zero is None else x + tf.cast(tf.expand_dims(zero, -1), x.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class _Pairs:
    """The (query group, key block) pairs of one `block_attention` call, and the scores and
    dropout of one pair. `k` [batch, heads, Lk, d]; `k_blocks` (start, size) of each key block."""
    k: tf.Tensor
    k_segments: tf.Tensor | None
    k_blocks: list
    causal: bool
    k_offset: int
    scale: float
    dropout_rate: float
    seed: Any

    def of(self, g: Group):
        """(key block index, whether the pair needs the causal mask) of each pair of group `g`."""
        for j, (ks, kn) in enumerate(self.k_blocks):
            if self.causal and ks + self.k_offset >= g.high:
                continue  # every key of the block is after every query of the group
            yield j, self.causal and ks + kn - 1 + self.k_offset >= g.low  # some key may be after some query

    def scores(self, qg, g: Group, j: int, masked: bool, zero):
        """The pair's masked scores, made after `zero`'s tensor (`_after`); qg has it added."""
        ks, kn = self.k_blocks[j]
        s = tf.cast(_contract("bhqd,bhkd->bhqk", qg, self.k[:, :, ks:ks + kn]) * tf.cast(self.scale, qg.dtype),
                    tf.float32)
        at = lambda x: x if zero is None else x + zero  # (-> [batch, heads, *rows])
        segments = k_segments_at = None
        if g.segments is not None:  # queries' [batch, 1, *rows]; keys' [batch, 1.., kn]
            segments = at(tf.expand_dims(g.segments, 1))
            k_segments_at = _expand(self.k_segments[:, ks:ks + kn], 1, s.shape.rank - 2)
        positions = at(g.positions)
        bias = scores_bias(segments, k_segments_at, positions, tf.range(ks, ks + kn) + self.k_offset, masked,
                           tf.float32)
        return s if bias is None else s + bias

    def drop(self, p, gi: int, j: int, zero):
        """p with the pair's dropout (p itself without)."""
        if not self.dropout_rate:
            return p
        return p * keep_mask(self.seed, tf.shape(p), self.dropout_rate, (gi, j), p.dtype, zero)


def _online_softmax(pairs: _Pairs, q, v, split, groups) -> tuple[list, list]:
    """The forward pass: (each group's output, each group's row statistics (max m, sum l)),
    pair after pair."""
    outs, stats, last = [], [], None
    for gi, (qg, g) in enumerate(zip(split(q), groups)):
        m = l = acc = None
        for j, masked in pairs.of(g):
            ks, kn = pairs.k_blocks[j]
            zero = _after(last)
            s = pairs.scores(_ordered(qg, zero), g, j, masked, zero)
            row_max = tf.reduce_max(s, axis=-1, keepdims=True)
            m_new = row_max if m is None else tf.maximum(m, row_max)
            p = tf.exp(s - m_new)
            pv = tf.cast(_contract("bhqk,bhkd->bhqd", tf.cast(pairs.drop(p, gi, j, zero), v.dtype),
                                   v[:, :, ks:ks + kn]), tf.float32)
            if m is None:
                l, acc = tf.reduce_sum(p, axis=-1, keepdims=True), pv
            else:
                correction = tf.exp(m - m_new)
                l = l * correction + tf.reduce_sum(p, axis=-1, keepdims=True)
                acc = acc * correction + pv
            m, last = m_new, m_new  # (the next pair's scores may overlap this pair's exp and p v)
        if m is None:  # no key at all: zeros (cannot happen with positions from 0)
            outs.append(tf.zeros_like(qg))
            stats.append((tf.zeros_like(qg[..., :1], tf.float32), tf.ones_like(qg[..., :1], tf.float32)))
            continue
        outs.append(tf.cast(acc / l, q.dtype))
        stats.append((m, l))  # (not m + log l: a row that may attend no key has m near -1e9, where log l is lost)
    return outs, stats


def _recomputed_gradient(pairs: _Pairs, q, k, v, split, merge, groups, outs, stats, d_out) -> tuple:
    """The backward pass: (dq, dk, dv) from d_out, each pair's probabilities recomputed from
    the forward's row statistics."""
    k_blocks = pairs.k_blocks
    d_q, d_k, d_v = [], [None] * len(k_blocks), [None] * len(k_blocks)
    add = lambda acc, x: x if acc is None else acc + x
    last = None
    for gi, (qg, do, o, (m, l), g) in enumerate(zip(split(q), split(d_out), outs, stats, groups)):
        row = tf.reduce_sum(tf.cast(do, tf.float32) * tf.cast(o, tf.float32), axis=-1, keepdims=True)
        dq = None
        for j, masked in pairs.of(g):
            ks, kn = k_blocks[j]
            kj, vj = k[:, :, ks:ks + kn], v[:, :, ks:ks + kn]
            zero = _after(row if last is None else last)  # (the first pair: not before dout exists)
            q_at, do_at = _ordered(qg, zero), _ordered(do, zero)
            p = tf.exp(pairs.scores(q_at, g, j, masked, zero) - m) / l
            keep = None
            if pairs.dropout_rate:
                keep = keep_mask(pairs.seed, tf.shape(p), pairs.dropout_rate, (gi, j), tf.float32, zero)
            p_kept = p if keep is None else p * keep
            d_v[j] = add(d_v[j], _contract("bhqk,bhqd->bhkd", tf.cast(p_kept, v.dtype), do_at))
            dp = tf.cast(_contract("bhqd,bhkd->bhqk", do_at, vj), tf.float32)
            ds = tf.cast(p * ((dp if keep is None else dp * keep) - row), q.dtype) * tf.cast(pairs.scale, q.dtype)
            dq = add(dq, _contract("bhqk,bhkd->bhqd", ds, kj))
            d_k[j] = add(d_k[j], _contract("bhqk,bhqd->bhkd", ds, q_at))
            last = p
        d_q.append(tf.zeros_like(qg) if dq is None else dq)
    fill = lambda parts, like: tf.concat(
        [x if x is not None else tf.zeros_like(like[:, :, s:s + n]) for x, (s, n) in zip(parts, k_blocks)], axis=2)
    return merge(d_q), fill(d_k, k), fill(d_v, v)


@tf.autograph.experimental.do_not_convert
def blockwise(q, k, v, q_segments=None, k_segments=None, causal: bool = False, block_size: int = 512,
              dropout_rate: float = 0.0, seed=None, q_offset: int = 0, k_offset: int = 0) -> tf.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v in blocks (see the module docstring).

    Args:
      q: [batch, heads, Lq, d]; k, v: [batch, heads, Lk, d] (static lengths).
      q_segments, k_segments: [batch, Lq], [batch, Lk] segment ids, or None.
      causal: a query attends no key at a later position.
      block_size: keys per block; the queries go in at most QUERY_GROUPS contiguous
        groups of whole blocks (`query_groups`).
      dropout_rate, seed: dropout on the probabilities; `seed` a [2] int tensor.
      q_offset, k_offset: the positions of q's and k's first rows (a chunk of a sequence).

    Returns:
      [batch, heads, Lq, d] in q's dtype.
    """
    lq = q.shape[2]
    if lq is None:
        raise ValueError("blockwise attention needs static sequence lengths")
    spans = query_groups(lq, block_size)
    groups = [Group(tf.range(s, s + n) + q_offset, None if q_segments is None else q_segments[:, s:s + n],
                    s + q_offset, s + n + q_offset) for s, n in spans]
    split = lambda x: [x[:, :, s:s + n] for s, n in spans]
    merge = lambda parts: tf.concat(parts, axis=2)
    if q_segments is None and k_segments is not None or q_segments is not None and k_segments is None:
        raise ValueError("blockwise attention: give both q_segments and k_segments, or neither")
    return block_attention(q, k, v, split, merge, groups, k_segments, causal, block_size, dropout_rate, seed,
                           k_offset)


def context_attention(q, k, v, segments, causal: bool, chunks: int, block_size: int) -> tf.Tensor:
    """Self-attention with the sequence split over the `context` mesh axis (`chunks` devices).

    q, k, v [batch, heads, L, d] and segments [batch, L] come in the balanced token order
    (tfpod.partitioning.context: device c holds chunks c and 2C-1-c of 2C), split over
    `context`. Keys and values (and their segment ids) are gathered whole on every device
    (the all-gather form of Llama 3's training; the gradient's relayout sums them back into
    the shards) and put back in sequence order; each device's queries go as two groups, its
    two chunks: the first lies in the sequence's first half, so under a causal mask it skips
    the second half's key blocks (every device then does the same 3/4 of the local
    queries x all keys work). The causal mask compares true token positions.
    """
    b, h, length, d = q.shape
    n = length // (2 * chunks)
    halves = lambda x, lead: tf.reshape(x, lead + [chunks, 2, n] + x.shape.as_list()[len(lead) + 1:])
    index = halves(shard(tf.constant(partitioning_context.zigzag(length, chunks), tf.int32), ("length",)), [])
    q_segments = None if segments is None else halves(segments, [b])  # [batch, C, 2, n]
    half = lambda i: None if q_segments is None else q_segments[:, :, i]
    groups = [Group(index[:, 0], half(0), 0, length // 2),  # chunk c < C
              Group(index[:, 1], half(1), length // 2, length)]  # chunk 2C-1-c >= C
    split = lambda x: [halves(x, [b, h])[:, :, :, i] for i in (0, 1)]  # [batch, heads, C, n, d] each
    merge = lambda parts: tf.reshape(tf.stack(parts, axis=3), [b, h, length, d])

    def in_order(x, lead):  # gathered over `context`, from the balanced order back to 0..L-1
        x = halves(shard(x, lead + (None,) + (("kv",) if x.shape.rank == 4 else ())), [b, h][:len(lead)])
        axis = len(lead)
        first, second = (tf.gather(x, i, axis=axis + 1) for i in (0, 1))  # chunks 0..C-1; 2C-1..C
        second = tf.gather(second, list(range(chunks - 1, -1, -1)), axis=axis)  # (DTensor has no ReverseV2)
        return tf.reshape(tf.concat([first, second], axis), x.shape.as_list()[:axis] + [length]
                          + x.shape.as_list()[axis + 3:])

    k, v = in_order(k, ("batch", "heads")), in_order(v, ("batch", "heads"))
    k_segments = None if segments is None else in_order(segments, ("batch",))
    return block_attention(q, k, v, split, merge, groups, k_segments, causal, block_size)


def materialized(q, k, v, q_segments=None, k_segments=None, causal: bool = False, keep=None,
                 q_offset: int = 0, k_offset: int = 0) -> tf.Tensor:
    """The same attention with the whole [batch, heads, Lq, Lk] score matrix (autodiff's
    gradient); `keep`: a dropout scale of that shape (tests build it from `keep_mask`'s blocks)."""
    lq, lk = q.shape[2], k.shape[2]
    s = tf.cast(tf.matmul(q, k, transpose_b=True) * tf.cast(q.shape[-1] ** -0.5, q.dtype), tf.float32)
    bias = mask_bias(q_segments, k_segments, tf.range(lq) + q_offset, tf.range(lk) + k_offset, causal, tf.float32)
    p = tf.nn.softmax(s if bias is None else s + bias, axis=-1)
    if keep is not None:
        p = p * keep
    return tf.cast(tf.matmul(tf.cast(p, v.dtype), v), q.dtype)


def dropout_keep(seed, shape, rate: float, block_size: int) -> tf.Tensor:
    """The whole [batch, heads, Lq, Lk] dropout scale that `blockwise` draws block by block
    (for tests and the materialized path's comparison)."""
    b, h, lq, lk = shape
    rows = []
    for i, (qs, qn) in enumerate(query_groups(lq, block_size)):
        rows.append(tf.concat([keep_mask(seed, [b, h, qn, kn], rate, (i, j), tf.float32)
                               for j, (ks, kn) in enumerate(_blocks(lk, block_size))], axis=-1))
    return tf.concat(rows, axis=2)
