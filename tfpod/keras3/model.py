"""Which distribution a Keras 3 model runs under, checked at compile / fit / evaluate / predict.

`install` wraps a few methods of Keras 3's TensorFlow trainer; each finds the model's
distribution (the one its variables were made under, or the current one for a model not
built yet) and runs Keras's own method inside `distribution.scope()` with batches placed on
its mesh, so that what Keras makes lazily (the optimizer's slots, metric state) is made
there too. A model with no variable on a mesh and no distribution set runs as plain Keras.

Never silently on one device: a model built before `set_distribution` and trained with it
set, a model with variables on two meshes or half on one device, or a distribution other
than the model's, stops with one line. Optimizer and metric state made outside the
distribution (an optimizer object made before it) is moved onto the mesh, with a log line.

On several hosts every host gathers the weights `model.save`, `save_weights` and
`BackupAndRestore` write (a collective), and host 0 alone writes and deletes the files: the
hosts share the file system they resume from, as tfpod's own checkpoints do.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import tempfile
import weakref

import numpy as np
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.keras3 import internals, steps, variables

log = logging.getLogger("tfpod")

_WRAPPED = ("compile", "fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
_ORIGINAL = {}


def _names(vs, limit: int = 3) -> str:
    paths = [v.path for v in vs]
    return ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def model_distribution(model, current=None):
    """The keras distribution `model` runs under (None: plain Keras).

    Raises:
      UserError: variables on one device while a distribution is set, variables on two
        meshes or only some on the mesh, or a current distribution on another mesh.
    """
    from keras import distribution as kd

    current = current if current is not None else kd.distribution()
    weights = list(model.variables)
    placed = [v for v in weights if variables.on_mesh(v)]
    plain = [v for v in weights if not variables.on_mesh(v)]
    name = f"model {model.name!r}"
    if placed and plain:
        raise UserError(f"{name}: variables {_names(plain)} are on one device and {_names(placed)} on the mesh: build "
                        "the whole model after keras.distribution.set_distribution(...) (or inside "
                        "distribution.scope())")
    if plain and current is not None:
        raise UserError(f"{name} was built before the distribution was set: its variables ({_names(plain)}) are on "
                        f"one device, and it would train unsharded under {current}: build it after "
                        "keras.distribution.set_distribution(...) or inside distribution.scope()")
    if not placed:
        return current
    made = {id(variables.distribution_of(v)): variables.distribution_of(v) for v in placed}
    meshes = {d.device_mesh.backend_mesh for d in made.values() if d is not None}
    if len(meshes) > 1:
        raise UserError(f"{name}: its variables were made under {len(meshes)} distributions with different meshes: "
                        "build the model under one")
    distribution = next(iter(made.values()))
    if current is not None and current.device_mesh.backend_mesh != distribution.device_mesh.backend_mesh:
        raise UserError(f"{name} was built under {distribution}, but {current} is set now: variables cannot move "
                        "between meshes; run it under the distribution it was built with")
    return distribution


def adopt_state(model, distribution) -> None:
    """Moves optimizer and metric variables made outside the distribution onto its mesh."""
    optimizer = getattr(model, "optimizer", None)  # none before compile
    state = list(getattr(optimizer, "variables", []) or []) + list(model.metrics_variables)
    moved = [v for v in state if internals.value_of(v) is not None and not variables.on_mesh(v)]
    for v in moved:
        variables.make_dvariable(v, distribution, v.numpy())
    if moved:
        log.info("keras.distribution: %d optimizer/metric variable(s) made outside the distribution moved onto its "
                 "mesh (%s)", len(moved), _names(moved))
        internals.reset_compiled_functions(model)


_CHECKED = weakref.WeakSet()  # models whose layout map coverage was reported


def report_layout_map(model, distribution) -> None:
    """Loud lines (once per model, once it is built) for a LayoutMap key that matches none of
    its variables, and for a ModelParallel model none of whose variables is split."""
    layout_map = getattr(distribution, "_layout_map", None)
    weights = list(model.weights)
    if layout_map is None or model in _CHECKED or not weights:
        return
    _CHECKED.add(model)
    paths = [v.path for v in weights]
    unmatched = [key for key in layout_map if not key.endswith("/output")
                 and not any(key == p or re.fullmatch(key, p) for p in paths)]
    if unmatched:
        log.warning("keras.distribution: LayoutMap key(s) %s match no variable of model %r (its variable paths are "
                    "like %s): what they were meant for is replicated", ", ".join(map(repr, unmatched)), model.name,
                    ", ".join(paths[:3]))
    if not any(not dtensor.fetch_layout(internals.value_of(v)).is_fully_replicated() for v in weights
               if variables.on_mesh(v)):
        log.warning("keras.distribution: ModelParallel splits no variable of model %r (every one is replicated: "
                    "data parallel only): check the LayoutMap's keys against its variable paths (%s, ...)",
                    model.name, ", ".join(paths[:3]))


def _wrap(name: str, original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        distribution = model_distribution(self)
        if distribution is None:
            return original(self, *args, **kwargs)
        with distribution.scope(), steps.feeding(self, distribution):
            if name != "compile":
                adopt_state(self, distribution)
            report_layout_map(self, distribution)
            result = original(self, *args, **kwargs)
            report_layout_map(self, distribution)
            return result

    return method


def _eager_call(original):
    """`model(x)` outside a step, on a model on the mesh: host inputs replicated onto its mesh
    (every device computes the whole batch: the outputs are replicated DTensors, whose
    `numpy()` is the whole output), run inside its distribution."""

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        import tensorflow as tf

        if (not tf.executing_eagerly() or steps.active_mesh() is not None
                or not any(variables.on_mesh(v) for v in self.variables)):
            return original(self, *args, **kwargs)
        distribution = model_distribution(self)
        mesh = distribution.device_mesh.backend_mesh

        def replicated(x):  # host arrays and tensors (not KerasTensors, not DTensors)
            if not (isinstance(x, np.ndarray) or isinstance(x, tf.Tensor) and not dtensor.is_dtensor(x)):
                return x
            from tfpod.keras3 import placement

            value = np.asarray(x)
            return placement.place(value, dtensor.Layout.replicated(mesh, value.ndim))

        def whole(y):  # an output a LayoutMap relaid out ("d2/output"), replicated again
            if isinstance(y, tf.Tensor) and dtensor.is_dtensor(y):
                return dtensor.relayout(y, dtensor.Layout.replicated(mesh, y.shape.rank))
            return y

        args, kwargs = tf.nest.map_structure(replicated, (args, kwargs))
        with distribution.scope():
            return tf.nest.map_structure(whole, original(self, *args, **kwargs))

    return __call__


@contextlib.contextmanager
def unsharded(model):
    """Within the block every variable of `model` is a plain tf.Variable holding its gathered
    value, and no distribution is set: what `model.export` writes (DTensor layouts do not
    go into a SavedModel). The DVariables are back after the block."""
    import tensorflow as tf
    from keras import distribution as kd

    swapped = []
    previous = kd.distribution()
    try:
        kd.set_distribution(None)
        for v in model.variables:
            value = internals.value_of(v)
            if variables.is_dvariable(value):
                plain = tf.Variable(v.numpy(), trainable=v.trainable, name=v.name)
                internals.set_value_of(v, plain)
                swapped.append((v, value))
        yield model
    finally:
        for v, value in swapped:
            internals.set_value_of(v, value)
        kd.set_distribution(previous)


def _export(original):
    @functools.wraps(original)
    def export(self, filepath, *args, **kwargs):
        if not any(variables.on_mesh(v) for v in self.variables):
            return original(self, filepath, *args, **kwargs)
        with unsharded(self):
            return original(self, filepath, *args, **kwargs)

    return export


def _chief_writes(original):
    """Model.save / save_weights on several hosts: every host gathers the weights (a collective),
    host 0 alone writes the file (the others write a temporary copy they delete)."""

    @functools.wraps(original)
    def save(self, filepath, *args, **kwargs):
        from tfpod.keras3 import backend

        if not any(variables.on_mesh(v) for v in self.variables) or backend.process_id() == 0:
            return original(self, filepath, *args, **kwargs)
        with tempfile.TemporaryDirectory() as scratch:
            return original(self, os.path.join(scratch, os.path.basename(str(filepath))), *args, **kwargs)

    return save


def _chief_backs_up(callback_class) -> None:
    """keras.callbacks.BackupAndRestore on several hosts: host 0 writes and deletes the backup
    (the others gather the weights with it and read the backup when they resume)."""
    from tfpod.keras3 import backend

    save, end = internals.backup_save_method(callback_class), callback_class.on_train_end

    @functools.wraps(save)
    def save_model(self):
        if not any(variables.on_mesh(v) for v in self.model.variables) or backend.process_id() == 0:
            return save(self)
        self.model.save_weights(internals.backup_weights_path(self), overwrite=True)  # gathered, not kept

    @functools.wraps(end)
    def on_train_end(self, logs=None):
        if not any(variables.on_mesh(v) for v in self.model.variables) or backend.process_id() == 0:
            return end(self, logs)

    internals.set_backup_save_method(callback_class, save_model)
    callback_class.on_train_end = on_train_end


def install() -> None:
    """Wraps the trainer methods above (once)."""
    if _ORIGINAL:
        return
    trainer = internals.trainer_module().TensorFlowTrainer
    for name in _WRAPPED:
        # compile in Keras's base Trainer, where it is defined: loading compares a model's compile to it
        owner = internals.base_trainer_class() if name == "compile" else trainer
        _ORIGINAL[name] = getattr(owner, name)
        setattr(owner, name, _wrap(name, _ORIGINAL[name]))
    import keras
    from keras import Model

    _ORIGINAL["export"] = Model.export
    Model.export = _export(Model.export)
    _ORIGINAL["__call__"] = Model.__call__
    Model.__call__ = _eager_call(Model.__call__)
    for name in ("save", "save_weights"):
        _ORIGINAL[name] = getattr(Model, name)
        setattr(Model, name, _chief_writes(_ORIGINAL[name]))
    _chief_backs_up(keras.callbacks.BackupAndRestore)
