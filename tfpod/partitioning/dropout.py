"""Mesh-wide random draws: dropout masks that a resumed run replays, equal on every replica.

`replayable_dropout` makes every Keras dropout layer of a model draw its mask from
(train.seed, layer, step) with stateless ops, so a resumed run (the step is in the
checkpoint) drops the same units as the run it continues, and a recomputed block draws
its forward pass's masks. On a mesh every draw is made in `random_layout`, which keeps
DTensor's per-device seeds right (see there).
"""

from __future__ import annotations

import functools
import zlib
from typing import Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import compat
from tfpod.partitioning.activations import active_context, within


def random_layout(shape: Sequence[int | None], mesh: dtensor.Mesh) -> dtensor.Layout:
    """The one layout every random draw of a step on `mesh` is generated in.

    DTensor gives each device of a sharded random op its own seed, computed from the
    device's coordinates on the mesh axes the op's layout shards. It reuses that seed
    computation between random ops of one function when their sharded axes match, but
    the match compares only a prefix: an op sharded over `data` alone then takes the
    seed of one sharded over `data` and `model`, and the devices of one `data` shard
    draw different values for a tensor that is replicated over `model`. Under the
    `tensor` preset that made the replicas of replicated weights drift apart as soon
    as two dropouts with differently sharded inputs (embeddings and attention
    probabilities) were on.

    So every draw is made sharded over all axes of more than one device (the first
    axis on the first dimension it divides, and so on), and relaid out to whatever
    its consumer needs; a shape that cannot hold all of them is drawn replicated (each
    device draws it whole, with the same seed). Either way the same seeds give the
    same values on every device that holds the same element.
    """
    axes = [a for a in mesh.dim_names if mesh.dim_size(a) > 1]
    specs = [dtensor.UNSHARDED] * len(shape)
    for axis in axes:
        free = [i for i, d in enumerate(shape) if specs[i] == dtensor.UNSHARDED and d and d % mesh.dim_size(axis) == 0]
        if not free:
            return dtensor.Layout.replicated(mesh, len(shape))
        specs[free[0]] = axis
    return dtensor.Layout(specs, mesh)


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


def _dropout(seed_fn, inputs: tf.Tensor, rate, noise_shape=None) -> tf.Tensor:
    """tf.nn.experimental.stateless_dropout, with its mask drawn in `random_layout`.

    On a mesh (inside `activation_sharding`) the uniform draw is relaid out to the one
    layout all draws share, which keeps DTensor's per-device seeds right (see
    `random_layout`); elsewhere it is TF's own stateless dropout.
    """
    active = active_context()
    shape = inputs.shape if noise_shape is None else tf.TensorShape(
        [d if d is not None else inputs.shape[i] for i, d in enumerate(noise_shape)])
    if active is None or not shape.is_fully_defined():
        return tf.nn.experimental.stateless_dropout(inputs, rate, seed=seed_fn(), noise_shape=noise_shape)
    uniform = tf.random.stateless_uniform(shape, seed=seed_fn(), dtype=inputs.dtype)
    uniform = dtensor.relayout(uniform, random_layout(shape.as_list(), active.mesh))
    keep = tf.cast(uniform >= rate, inputs.dtype)
    return inputs * tf.cast(1.0 / (1.0 - rate), inputs.dtype) * keep


def replayable_dropout(model: tf.Module, step: tf.Variable, seed: int) -> int:
    """Makes every dropout layer of `model` draw its masks from (seed, layer, step).

    Keras dropout under `enable_tf_random_generator` draws from a random state that is
    not in the checkpoint, so a resumed run would drop different units than the run it
    continues. Stateless masks seeded by the step counter (which is checkpointed) make
    the resumed steps the same as the uninterrupted ones, and make a recomputed block
    draw the same masks as its forward pass. On a mesh the masks are drawn in
    `random_layout` (see `_dropout`), which keeps replicated weights' replicas equal.

    Returns:
      How many layers now draw replayable masks.
    """
    n = 0
    for i, layer in enumerate(compat.flatten_layers(model, include_self=False)):
        layer_seed = zlib.crc32(f"{seed}/{i}".encode()) & 0x7FFFFFFF  # not the name: unique per process
        seed_fn = functools.partial(_step_seed, step, layer_seed)
        n += compat.stateless_dropout_generator(layer, seed_fn, functools.partial(_dropout, seed_fn))
    return n
