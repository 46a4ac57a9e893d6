"""Attention that never holds the length x length matrix: queries and keys in blocks with an
online softmax (FlashAttention; Rabe and Staats), and a gradient that recomputes each block.

    out = softmax(q k^T / sqrt(d) + mask) v        q [batch, heads, Lq, d], k and v [batch, heads, Lk, d]

The mask is never a tensor of its own: a query may attend a key when their segment ids are
equal (packed documents; padding is a segment of its own, 0 by convention) and, with
`causal`, when the key's position is not after the query's. Each block's additive mask
(-1e9 where not allowed, as the materialized path's) is made from the block's positions and
segment ids. Blocks wholly above the diagonal of a causal mask are skipped (known when the
positions are static: 0..L-1 plus an offset).

Forward, per query block: a running row max m and sum l over key blocks,

    s = q_i k_j^T * scale + mask_ij;  m' = max(m, rowmax s);  p = exp(s - m')
    l = l * exp(m - m') + rowsum p;    acc = acc * exp(m - m') + dropout(p) v_j

and out_i = acc / l; only out and the row statistics lse = m + log l are kept. Backward,
per block, with D = rowsum(dout * out) (which holds with dropout too):

    p = exp(s - lse);  dv_j += dropout(p)^T dout_i;  dp = dropout'(dout_i v_j^T)
    ds = p * (dp - D);  dq_i += ds k_j * scale;  dk_j += ds^T q_i * scale

Dropout on the probabilities draws each block's keep mask from a stateless seed and the
block's indices, so the backward draws the same masks (`keep_mask`).

`materialized` is the same function with the whole [batch, heads, Lq, Lk] matrix (the path
tfpod used before; tests compare the two).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfpod import UserError, fused

NEG = -1e9  # the additive mask where a query may not attend (as the materialized path's)
IMPLEMENTATIONS = ("blockwise", "materialized")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """gin: `attention.implementation` and `attention.block_size`.

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


_CURRENT = [AttentionConfig()]


def use(config: AttentionConfig) -> None:
    """Makes `config` the attention every model built or traced from now on runs (a run's
    gin `attention.*`, set by tfpod.api when it builds the run's configs)."""
    _CURRENT[0] = config


def current() -> AttentionConfig:
    return _CURRENT[0]


def self_attention_mask(ids: tf.Tensor, segment_ids: tf.Tensor | None, dense) -> tf.Tensor:
    """What a model's blocks pass their attention for the mask: segment ids [batch, length]
    (ones without packing) for blockwise attention, else `dense(ids, segment_ids)`, the
    [batch, length, length] mask."""
    if current().implementation == "blockwise":
        return tf.ones_like(ids, tf.int32) if segment_ids is None else tf.cast(segment_ids, tf.int32)
    return dense(ids, segment_ids)


def dropout_seed(dropout) -> tf.Tensor | None:
    """The [2] int64 stateless seed a Keras dropout layer would draw its next mask from, or
    None (a layer without a stateless seed: Keras's legacy stateful dropout).

    Under tfpod's trainer (tfpod.partitioning.replayable_dropout) this is (train.seed, layer,
    microbatch, step): a resumed run and a recomputed block draw the same masks."""
    generator = getattr(dropout, "_random_generator", None)
    make = getattr(generator, "make_seed_for_stateless_op", None)
    seed = make() if make is not None else None
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
    None for a dense mask: segment ids [batch, length] are both; a key mask [batch, 1, Lk] (1
    where every query may attend the key: padding) gives keys its 1s and 0s and every query 1."""
    if mask.shape.rank == 2:
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
    if lq is not None and lk is not None and dropping is not None and (seed is not None or not dropping):
        size = current().block_size
        if causal and lq == lk and lq % 2 == 0:
            size = min(size, lq // 2)  # at least two blocks: the causal mask skips a quarter
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
    """The additive mask [batch or 1, 1, lq, lk] of a block (None: every query attends every key).

    Args:
      q_segments, k_segments: [batch, lq], [batch, lk] int segment ids, or None (one segment).
      q_positions, k_positions: [lq], [lk] int positions (for `causal`).
    """
    # (tf.expand_dims, not x[:, None]: DTensor's layout pass for a strided slice that adds an axis fails)
    allowed = None
    if q_segments is not None:
        allowed = tf.equal(tf.expand_dims(q_segments, 2), tf.expand_dims(k_segments, 1))  # [batch, lq, lk]
    if causal:
        lower = tf.expand_dims(tf.expand_dims(q_positions, 1) >= tf.expand_dims(k_positions, 0), 0)  # [1, lq, lk]
        allowed = lower if allowed is None else tf.logical_and(allowed, lower)
    if allowed is None:
        return None
    return tf.expand_dims((1.0 - tf.cast(allowed, dtype)) * tf.constant(NEG, dtype), 1)


def keep_mask(seed, shape, rate: float, block: tuple[int, int], dtype) -> tf.Tensor:
    """The dropout scale of one block's probabilities: 0 where dropped, 1 / (1 - rate) where kept,
    drawn from `seed` ([2] int) and the block's (query block, key block) indices.

    The draw is a counter-based hash of the seed, the block and each element's index in it
    (`_uniform`), not a random op: every device computes the values of the elements it holds,
    equal to one device's whatever the layout (DTensor seeds a sharded random op per device,
    see tfpod.partitioning.random_layout), with no draw of a replicated whole."""
    keep = _uniform(seed, shape, block) >= rate
    return tf.cast(keep, dtype) * tf.cast(1.0 / (1.0 - rate), dtype)


def _fmix(x: tf.Tensor) -> tf.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection of uint32 that mixes every bit into every other)."""
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(shift, tf.uint32)))
        x = x * tf.constant(factor, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))


_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: the Weyl step between consecutive counters


def _uniform(seed, shape, block: tuple[int, int]) -> tf.Tensor:
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
    cell = tf.cast(tf.reshape(tf.range(rows), [-1, 1]), tf.uint32) * tf.cast(cols, tf.uint32) + \
        tf.cast(tf.reshape(tf.range(cols), [1, -1]), tf.uint32)  # [rows, cols]
    bits = _fmix(row_key + cell * tf.constant(_GOLDEN, tf.uint32))  # [b, h, rows, cols]
    return tf.cast(tf.bitwise.right_shift(bits, tf.constant(8, tf.uint32)), tf.float32) * (2.0 ** -24)


def _blocks(length: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(size, length - start)) for start in range(0, length, size)]


@tf.autograph.experimental.do_not_convert
def blockwise(q, k, v, q_segments=None, k_segments=None, causal: bool = False, block_size: int = 512,
              dropout_rate: float = 0.0, seed=None, q_offset: int = 0, k_offset: int = 0) -> tf.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v in blocks (see the module docstring).

    Args:
      q: [batch, heads, Lq, d]; k, v: [batch, heads, Lk, d] (static lengths).
      q_segments, k_segments: [batch, Lq], [batch, Lk] segment ids, or None.
      causal: a query attends no key at a later position.
      block_size: queries and keys per block.
      dropout_rate, seed: dropout on the probabilities; `seed` a [2] int tensor.
      q_offset, k_offset: the positions of q's and k's first rows (a chunk of a sequence).

    Returns:
      [batch, heads, Lq, d] in q's dtype.
    """
    lq, lk = q.shape[2], k.shape[2]
    if lq is None or lk is None:
        raise ValueError("blockwise attention needs static sequence lengths")
    q_blocks, k_blocks = _blocks(lq, block_size), _blocks(lk, block_size)
    scale = q.shape[-1] ** -0.5
    if dropout_rate and seed is None:
        raise ValueError("blockwise attention with dropout needs a seed")

    def pairs():
        """(query block, key block) index pairs with a key any query may attend (static)."""
        for i, (qs, qn) in enumerate(q_blocks):
            for j, (ks, kn) in enumerate(k_blocks):
                if causal and ks + k_offset > qs + qn - 1 + q_offset:
                    continue  # every key of the block is after every query of it
                yield i, j

    plan = {}
    for i, j in pairs():
        plan.setdefault(i, []).append(j)

    def block_terms(qi, kj, i, j, q_seg, k_seg):
        (qs, qn), (ks, kn) = q_blocks[i], k_blocks[j]
        s = tf.matmul(qi, kj, transpose_b=True) * tf.cast(scale, qi.dtype)  # [b, h, qn, kn]
        s = tf.cast(s, tf.float32)
        needs_causal = causal and ks + kn - 1 + k_offset > qs + q_offset  # some key after some query
        bias = mask_bias(None if q_seg is None else q_seg[:, qs:qs + qn],
                         None if k_seg is None else k_seg[:, ks:ks + kn],
                         tf.range(qs, qs + qn) + q_offset, tf.range(ks, ks + kn) + k_offset, needs_causal, tf.float32)
        return s if bias is None else s + bias

    def drop(p, i, j):
        if not dropout_rate:
            return p
        return p * keep_mask(seed, tf.shape(p), dropout_rate, (i, j), p.dtype)

    @tf.custom_gradient
    def core(q, k, v):
        outs, stats = [], []
        for i, (qs, qn) in enumerate(q_blocks):
            qi = q[:, :, qs:qs + qn]
            m = l = acc = None
            for j in plan.get(i, []):
                ks, kn = k_blocks[j]
                s = block_terms(qi, k[:, :, ks:ks + kn], i, j, q_segments, k_segments)
                row_max = tf.reduce_max(s, axis=-1, keepdims=True)
                m_new = row_max if m is None else tf.maximum(m, row_max)
                p = tf.exp(s - m_new)
                pv = tf.matmul(tf.cast(drop(p, i, j), v.dtype), v[:, :, ks:ks + kn])
                if m is None:
                    l, acc = tf.reduce_sum(p, axis=-1, keepdims=True), tf.cast(pv, tf.float32)
                else:
                    correction = tf.exp(m - m_new)
                    l = l * correction + tf.reduce_sum(p, axis=-1, keepdims=True)
                    acc = acc * correction + tf.cast(pv, tf.float32)
                m = m_new
            if m is None:  # no key at all (cannot happen with static positions from 0): zeros
                outs.append(tf.zeros_like(qi))
                stats.append(tf.zeros(tf.concat([tf.shape(qi)[:3], [1]], 0), tf.float32))
                continue
            outs.append(tf.cast(acc / l, q.dtype))
            stats.append(m + tf.math.log(l))
        out = tf.concat(outs, axis=2)
        lse = tf.concat(stats, axis=2)  # [b, h, Lq, 1]

        def grad(d_out):
            row = tf.reduce_sum(tf.cast(d_out, tf.float32) * tf.cast(out, tf.float32), axis=-1, keepdims=True)
            d_q = [None] * len(q_blocks)
            d_k, d_v = [None] * len(k_blocks), [None] * len(k_blocks)
            add = lambda acc, x: x if acc is None else acc + x
            for i, (qs, qn) in enumerate(q_blocks):
                qi, do_i = q[:, :, qs:qs + qn], d_out[:, :, qs:qs + qn]
                for j in plan.get(i, []):
                    ks, kn = k_blocks[j]
                    kj, vj = k[:, :, ks:ks + kn], v[:, :, ks:ks + kn]
                    p = tf.exp(block_terms(qi, kj, i, j, q_segments, k_segments) - lse[:, :, qs:qs + qn])
                    keep = keep_mask(seed, tf.shape(p), dropout_rate, (i, j), tf.float32) if dropout_rate else None
                    pd = p if keep is None else p * keep
                    d_v[j] = add(d_v[j], tf.matmul(tf.cast(pd, v.dtype), do_i, transpose_a=True))
                    dp = tf.cast(tf.matmul(do_i, vj, transpose_b=True), tf.float32)
                    if keep is not None:
                        dp = dp * keep
                    ds = tf.cast(p * (dp - row[:, :, qs:qs + qn]), q.dtype) * tf.cast(scale, q.dtype)
                    d_q[i] = add(d_q[i], tf.matmul(ds, kj))
                    d_k[j] = add(d_k[j], tf.matmul(ds, qi, transpose_a=True))
            fill = lambda parts, blocks, like: tf.concat(
                [x if x is not None else tf.zeros_like(like[:, :, s:s + n]) for x, (s, n) in zip(parts, blocks)], axis=2)
            return fill(d_q, q_blocks, q), fill(d_k, k_blocks, k), fill(d_v, k_blocks, v)

        return out, grad

    return core(q, k, v)


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
    for i, (qs, qn) in enumerate(_blocks(lq, block_size)):
        rows.append(tf.concat([keep_mask(seed, [b, h, qn, kn], rate, (i, j), tf.float32)
                               for j, (ks, kn) in enumerate(_blocks(lk, block_size))], axis=-1))
    return tf.concat(rows, axis=2)
