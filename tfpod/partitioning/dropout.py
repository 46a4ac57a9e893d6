"""Mesh-wide random draws: dropout masks that a resumed run replays, equal on every mesh.

`replayable_dropout` makes every Keras dropout layer of a model draw its mask from
(train.seed, layer, step), so a resumed run (the step is in the checkpoint) drops the same
units as the run it continues, and a recomputed block draws its forward pass's masks. The
draw is a counter-based hash of that seed and each element's index (`counter_uniform`), not
a random op: DTensor seeds a sharded random op per device from its coordinates on the mesh,
so such a draw differs from one mesh to another (and once differed between the replicas of
one mesh, see docs/benchmarks.md); the hash gives every mesh and layout one device's masks.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import compat
from tfpod.partitioning.step_context import active_context, within


def microbatch(index):
    """Within this block of a step's trace dropout masks are drawn for microbatch `index` of
    the step (an int, or the int32 loop counter of the train step's accumulation).

    Raises:
      RuntimeError: no step is being traced.
    """
    return within(f"microbatch({index})", microbatch=index)


def _step_seed(step: tf.Variable, layer_seed: int) -> tf.Tensor:
    """The stateless seed of one dropout layer at the current step (and microbatch):
    [layer_seed + microbatch * 2^32, step].

    Raises:
      RuntimeError: a step that accumulates microbatches draws a mask outside `microbatch`
        (every microbatch would drop the same units).
    """
    context = active_context()
    index = None if context is None else context.microbatch
    if index is None and context is not None and context.microbatches > 1:
        raise RuntimeError(f"a dropout mask drawn in a step of {context.microbatches} microbatches outside "
                           f"partitioning.microbatch(index): each microbatch must draw its own masks")
    if index is None or isinstance(index, int):
        first = tf.constant(layer_seed + ((index or 0) << 32), tf.int64)
    else:
        first = tf.constant(layer_seed, tf.int64) + tf.cast(index, tf.int64) * (1 << 32)
    return tf.stack([first, tf.cast(step, tf.int64)])


_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: the Weyl step between consecutive counters


def _fmix(x: tf.Tensor) -> tf.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection of uint32 that mixes every bit into every other)."""
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(shift, tf.uint32)))
        x = x * tf.constant(factor, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))


def counter_bits(seed, shape: Sequence[int]) -> tf.Tensor:
    """Uniform uint32 bits of the static `shape`, drawn from `seed` ([2] int64) by a
    counter-based hash: element (i0, ..., ik) is fmix(... fmix(fmix(key + i0 * G) + i1 * G)
    ... + ik * G), with `key` a hash of the seed. No random op: each device computes the
    elements it holds, and they equal one device's whatever the mesh and the layout
    (DTensor seeds a sharded random op per device, from its coordinates on the mesh).
    Each dimension below 2^32."""
    seed = tf.cast(seed, tf.int64)
    key = tf.constant(_GOLDEN, tf.uint32)
    for word in (seed[0], tf.bitwise.right_shift(seed[0], 32), seed[1], tf.bitwise.right_shift(seed[1], 32)):
        word = tf.cast(tf.bitwise.bitwise_and(word, 0xFFFFFFFF), tf.uint32)
        key = _fmix(tf.bitwise.bitwise_xor(key, word) + tf.constant(_GOLDEN, tf.uint32))
    bits, rank = key, len(shape)
    for i, size in enumerate(shape):
        # (tf.reshape, not x[:, None]: a strided slice that adds an axis fails under DTensor)
        index = tf.cast(tf.reshape(tf.range(size), [size if j == i else 1 for j in range(rank)]), tf.uint32)
        bits = _fmix(bits + index * tf.constant(_GOLDEN, tf.uint32))  # grows to shape[:i + 1]
    return bits


def counter_uniform(seed, shape: Sequence[int]) -> tf.Tensor:
    """Float32 uniforms in [0, 1) of `shape`: `counter_bits`' top 24 bits."""
    bits = counter_bits(seed, shape)
    return tf.cast(tf.bitwise.right_shift(bits, tf.constant(8, tf.uint32)), tf.float32) * (2.0 ** -24)


def _dropout(seed_fn, inputs: tf.Tensor, rate, noise_shape=None) -> tf.Tensor:
    """Dropout whose keep mask is `counter_uniform(seed_fn(), shape) >= rate`: the same
    units on every mesh and layout as on one device (and off a mesh). A shape not known
    when the step is traced takes TF's own stateless dropout (the same seed, another draw).
    """
    shape = inputs.shape if noise_shape is None else tf.TensorShape(
        [d if d is not None else inputs.shape[i] for i, d in enumerate(noise_shape)])
    if not shape.is_fully_defined():
        return tf.nn.experimental.stateless_dropout(inputs, rate, seed=seed_fn(), noise_shape=noise_shape)
    # keep where uniform >= rate, the uniform being the bits' top 24 over 2^24 (as counter_uniform)
    threshold = tf.constant(min(2 ** 32 - 1, math.ceil(rate * 2 ** 24) << 8), tf.uint32)
    keep = tf.cast(counter_bits(seed_fn(), shape.as_list()) >= threshold, inputs.dtype)
    active = active_context()
    if active is not None and tf.executing_eagerly():  # (traced, DTensor lays the mask out where it is used)
        keep = dtensor.copy_to_mesh(keep, dtensor.Layout.replicated(active.mesh, shape.rank))
    return inputs * tf.cast(1.0 / (1.0 - rate), inputs.dtype) * keep


def replayable_dropout(model: tf.Module, step: tf.Variable, seed: int) -> int:
    """Makes every dropout layer of `model` draw its masks from (seed, layer, step).

    Keras dropout under `enable_tf_random_generator` draws from a random state that is
    not in the checkpoint, so a resumed run would drop different units than the run it
    continues. Stateless masks seeded by the step counter (which is checkpointed) make
    the resumed steps the same as the uninterrupted ones, and make a recomputed block
    draw the same masks as its forward pass. The masks are `counter_uniform`'s (see `_dropout`):
    one device's on every mesh, equal on every replica of a replicated weight's inputs.

    Returns:
      How many layers now draw replayable masks.
    """
    n = 0
    for i, layer in enumerate(compat.flatten_layers(model, include_self=False)):
        layer_seed = zlib.crc32(f"{seed}/{i}".encode()) & 0x7FFFFFFF  # not the name: unique per process
        seed_fn = functools.partial(_step_seed, step, layer_seed)
        n += compat.stateless_dropout_generator(layer, seed_fn, functools.partial(_dropout, seed_fn))
    return n
