"""Random draws in a step on the mesh are one device's draws.

DTensor gives each device of a sharded random op its own seed (tfpod.partitioning.dropout
explains how), so a dropout mask drawn in the layout of a batch-sharded activation is not
the mask one device draws from the same seed: the losses drift from one device's. While a
model on the mesh traces its step, `install`'s wrappers of Keras's TensorFlow random ops
draw every tensor replicated (each device draws the whole tensor from the same seed, as one
device does) and relay it out to where it is used; categorical draws and shuffles read
their inputs replicated first. Dropout follows `tf.nn.experimental.stateless_dropout`
exactly, with the mask drawn so. Outside such a step Keras's own functions run.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod.keras3 import internals

_ORIGINAL = {}
_SHAPED = ("normal", "uniform", "randint", "truncated_normal", "gamma", "binomial", "beta")


def _mesh():
    from tfpod.keras3 import steps

    return steps.active_mesh()


def _replicated(x, mesh):
    return dtensor.relayout(x, dtensor.Layout.replicated(mesh, x.shape.rank))


def _drawn_replicated(name: str, original):
    @functools.wraps(original)
    def draw(*args, **kwargs):
        mesh = _mesh()
        if mesh is None:
            return original(*args, **kwargs)
        return _replicated(original(*args, **kwargs), mesh)

    return draw


def _read_replicated(name: str, original):
    @functools.wraps(original)
    def draw(x, *args, **kwargs):
        mesh = _mesh()
        if mesh is None:
            return original(x, *args, **kwargs)
        return _replicated(original(_replicated(tf.convert_to_tensor(x), mesh), *args, **kwargs), mesh)

    return draw


def dropout(inputs, rate, noise_shape=None, seed=None):
    """keras.random.dropout (TensorFlow backend) with the keep mask drawn replicated on the mesh."""
    mesh = _mesh()
    if mesh is None or rate == 0.0 or rate == 1.0:
        return _ORIGINAL["dropout"](inputs, rate, noise_shape=noise_shape, seed=seed)
    seed = internals.draw_seed(seed)
    inputs = tf.convert_to_tensor(inputs)
    if noise_shape is None and inputs.shape.is_fully_defined():
        shape = inputs.shape.as_list()
    else:
        shape = internals.concrete_noise_shape(inputs, noise_shape)
    # As tf.nn.experimental.stateless_dropout: x * (1 / keep), zero where uniform < rate.
    # (Python numbers made tensors in the inputs' dtype directly: tf.cast would round them to float32 first.)
    kept = inputs * tf.constant(1.0 / (1.0 - rate), inputs.dtype)
    uniform = _replicated(tf.random.stateless_uniform(shape, seed=seed, dtype=inputs.dtype), mesh)
    return tf.where(uniform >= tf.constant(rate, inputs.dtype), kept, tf.zeros([], inputs.dtype))


def install() -> None:
    """Wraps the TensorFlow backend's random ops (once)."""
    if _ORIGINAL:
        return
    module = internals.random_module()
    for name in _SHAPED + ("categorical", "shuffle", "dropout"):
        _ORIGINAL[name] = getattr(module, name)
    for name in _SHAPED:
        setattr(module, name, _drawn_replicated(name, _ORIGINAL[name]))
    for name in ("categorical", "shuffle"):
        setattr(module, name, _read_replicated(name, _ORIGINAL[name]))
    module.dropout = dropout
