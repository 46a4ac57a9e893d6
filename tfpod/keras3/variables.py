"""Keras 3 variables made under a distribution are DTensor variables in their layouts.

Keras 3's TensorFlow `Variable` wraps a `tf.Variable` (`_value`). Under a
`keras.distribution` (set with `set_distribution` or `distribution.scope()`), `install`
makes that a `dtensor.DVariable` laid out as `distribution.get_variable_layout(variable)`
says: the LayoutMap's entry for the variable's path under `ModelParallel` (a layout a
variable was given explicitly, such as an optimizer slot's, which Keras copies from its
weight), replicated otherwise. The initial value is computed on the host, as without a
distribution (the same seed gives the same weights on any mesh), checked against the
layout (rank, divisibility: one line naming the variable's path) and placed piece by piece.

`assign` of a host value places it in the variable's layout; `numpy()` and `np.asarray`
gather the whole value. Without a distribution nothing changes.
"""

from __future__ import annotations

import functools
import logging
import sys

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.keras3 import backend, internals, placement

log = logging.getLogger("tfpod")

_ORIGINAL = {}
_MADE_UNDER = "tfpod_keras_distribution"  # attribute of a DVariable made here: the distribution it was made under


def is_dvariable(value) -> bool:
    return isinstance(value, dtensor.DVariable)


def on_mesh(variable) -> bool:
    """Whether a Keras variable holds a DVariable."""
    return is_dvariable(internals.value_of(variable))


def distribution_of(variable):
    """The keras distribution a Keras variable was made under (None: made without one)."""
    value = internals.value_of(variable)
    return getattr(value, _MADE_UNDER, None) if is_dvariable(value) else None


def distribution_of_value(value):
    return getattr(value, _MADE_UNDER, None)


def _refuse_under_tf_keras_sharding(variable) -> None:
    """One line when a Keras 3 variable is made inside tfpod.sharding (tf_keras's front end)."""
    if "tf_keras" not in sys.modules:  # no tf_keras, no tfpod.sharding block
        return
    from tfpod import compat

    if compat.layout_map_lib().get_current_layout_map() is not None:
        from tfpod.keras.support import keras3_refusal

        raise UserError(keras3_refusal(f"the Keras 3 variable {variable.path!r}", "is made inside tfpod.sharding"))


def _host_value(variable, value):
    """The initial value on the host (an initializer called outside any step being traced)."""
    with tf.init_scope():
        if callable(value):
            value = value()
        if isinstance(value, tf.Variable):
            value = value.read_value()
        if isinstance(value, tf.Tensor) and dtensor.is_dtensor(value):
            return placement.gather(value)
        return np.asarray(tf.cast(tf.convert_to_tensor(value), internals.dtype_of(variable)))


def _check_seeded() -> None:
    """On several hosts every host computes every initial value itself: only one seed makes them equal."""
    if backend.num_processes() > 1 and internals.global_seed() is None:
        raise UserError("keras.distribution on several hosts: every host computes the initial weights itself, so "
                        "call keras.utils.set_random_seed(seed) with the same seed on every host before building "
                        "the model")


def make_dvariable(variable, distribution, value) -> None:
    """Makes a Keras variable's backend variable a DVariable of `value` in its layout under `distribution`."""
    if internals.shape_of(variable) is None:
        internals.set_shape_of(variable, tuple(np.shape(value)))
    layout = distribution.get_variable_layout(variable)
    if isinstance(layout, internals.tensor_layout_class()) and layout.device_mesh is None:
        layout.device_mesh = distribution.device_mesh
    target = backend.backend_layout(layout)
    if target.mesh != distribution.device_mesh.backend_mesh:
        raise UserError(f"variable {variable.path!r}: its layout is on another mesh than the distribution's "
                        f"{distribution.device_mesh}: make the LayoutMap with the distribution's DeviceMesh")
    placement.check_layout(target, np.shape(value), f"variable {variable.path!r}")
    internals.set_layout_of(variable, layout)
    with tf.init_scope():
        dvariable = dtensor.DVariable(placement.place(value, target), trainable=variable.trainable,
                                      name=variable.name, aggregation=internals.aggregation_of(variable))
    setattr(dvariable, _MADE_UNDER, distribution)
    internals.set_value_of(variable, dvariable)


def _initialize(self, value):
    from keras import distribution as kd

    distribution = kd.distribution()
    if distribution is None:
        _refuse_under_tf_keras_sharding(self)
        return _ORIGINAL["_initialize"](self, value)
    if is_dvariable(value):
        if distribution_of_value(value) is None:
            setattr(value, _MADE_UNDER, distribution)
        return _ORIGINAL["_initialize"](self, value)
    if isinstance(value, tf.Variable):
        log.warning("keras.distribution: variable %r was given a tf.Variable on one device; it gets a copy on the "
                    "mesh (the tf.Variable itself is not updated)", self.path)
    _check_seeded()
    make_dvariable(self, distribution, _host_value(self, value))


def compute_layout(layout: dtensor.Layout, batch_axis: str | None) -> dtensor.Layout:
    """A weight's layout for computing with it: its storage layout less the batch axis.

    A LayoutMap may split a weight over the batch axis too (KerasHub's maps do: fully
    sharded storage); DTensor cannot contract two operands split over different axes
    ("Contracting dimension for matmul has sharding dimension batch for the left input and
    model for the right input"), so a step gathers such a weight over the batch axis where it
    uses it, and its gradient arrives split as it is stored (a reduce-scatter), as XLA does
    for the same layouts on JAX.
    """
    specs = [dtensor.UNSHARDED if s == batch_axis else s for s in layout.sharding_specs]
    return dtensor.Layout(specs, layout.mesh)


UPDATING: list = []  # set while the optimizer updates: it works on the stored layouts


def _tf_tensor(self, dtype=None, name=None):
    value = _ORIGINAL["__tf_tensor__"](self, dtype, name)
    target = internals.value_of(self)
    if UPDATING or not is_dvariable(target) or tf.executing_eagerly():
        return value
    from tfpod.keras3 import steps

    batch_axis = steps.active_batch_axis()
    if batch_axis is None or batch_axis not in target.layout.sharding_specs:
        return value
    return dtensor.relayout(value, compute_layout(target.layout, batch_axis))


def _direct_assign(self, value):
    target = internals.value_of(self)
    if is_dvariable(target) and not tf.executing_eagerly():
        value = dtensor.relayout(tf.cast(value, target.dtype), target.layout)  # in a step: the stored layout
    if is_dvariable(target) and tf.executing_eagerly():
        layout = dtensor.fetch_layout(target)
        if isinstance(value, tf.Tensor) and dtensor.is_dtensor(value):
            if dtensor.fetch_layout(value) != layout:
                value = dtensor.relayout(value, layout)
        else:
            value = np.asarray(tf.cast(value, target.dtype))
            placement.check_layout(layout, value.shape, f"variable {self.path!r}")
            value = placement.place(value, layout)
    return _ORIGINAL["_direct_assign"](self, value)


def _numpy(self):
    target = internals.value_of(self)
    if is_dvariable(target):
        return placement.gather(target.read_value())
    return _ORIGINAL["numpy"](self)


def _array(self, dtype=None, copy=None):
    target = internals.value_of(self)
    if is_dvariable(target):
        return np.asarray(placement.gather(target.read_value()), dtype=dtype)
    return _ORIGINAL["__array__"](self, dtype)


def _global_seed_generator(original):
    """Keras's global seed generator (what initializers without a seed draw from), made off the
    mesh: initial values are computed on the host."""

    @functools.wraps(original)
    def global_seed_generator():
        from keras import distribution as kd

        distribution = kd.distribution()
        if distribution is None:
            return original()
        kd.set_distribution(None)
        try:
            return original()
        finally:
            kd.set_distribution(distribution)

    return global_seed_generator


def install() -> None:
    """Replaces the TensorFlow Keras Variable's methods above (once)."""
    cls = internals.variable_class()
    if _ORIGINAL:
        return
    for name, function in (("_initialize", _initialize), ("_direct_assign", _direct_assign), ("numpy", _numpy),
                           ("__array__", _array), ("__tf_tensor__", _tf_tensor)):
        _ORIGINAL[name] = getattr(cls, name)
        setattr(cls, name, function)
    seeds = internals.seed_generator_module()
    _ORIGINAL["global_seed_generator"] = seeds.global_seed_generator
    seeds.global_seed_generator = _global_seed_generator(seeds.global_seed_generator)
