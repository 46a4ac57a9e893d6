"""Keras 3's own train, test and predict steps, compiled as one SPMD program on the mesh.

Keras 3's TensorFlow trainer wraps its step in `tf.distribute` calls and loops
`steps_per_execution` steps over a tf.data iterator with `tf.experimental.Optional`,
which DTensor cannot lay out ("'tf.OptionalFromValue' op does not implement layout
propagation"). For a model whose variables are on a mesh `install` swaps in:

  make_function          Keras's `train_step` / `test_step` in one tf.function (its
                         jit_compile), called once per batch placed on the mesh
                         (data.MeshBatches), `steps_per_execution` batches per call
  make_predict_function  `predict_step` with every output gathered to the host
  EpochIterator          Keras's epoch iterator over MeshBatches of its own dataset

Models without DVariables keep Keras's functions; nothing changes without a distribution.
"""

from __future__ import annotations

import contextlib
import weakref

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod.keras3 import data, internals

_ORIGINAL = {}
_PLACERS = weakref.WeakKeyDictionary()  # model -> BatchPlacer (its distribution's mesh)
_ACTIVE: list = []  # the BatchPlacer of the fit / evaluate / predict running now


class Placed:
    """A batch already on the mesh (what MeshBatches yields)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _PlacedBatches(data.MeshBatches):
    def __iter__(self):
        for batch in super().__iter__():
            yield Placed(batch)


def placer_for(model, distribution) -> data.BatchPlacer:
    placer = _PLACERS.get(model)
    if placer is None or placer.distribution is not distribution:
        placer = _PLACERS[model] = data.BatchPlacer(distribution)
    return placer


@contextlib.contextmanager
def feeding(model, distribution):
    """Within the block Keras's epoch iterators place batches on `distribution`'s mesh."""
    _ACTIVE.append(placer_for(model, distribution))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active_mesh() -> dtensor.Mesh | None:
    """The mesh of the model on the mesh whose fit / evaluate / predict runs now (None: none)."""
    return _ACTIVE[-1].mesh if _ACTIVE else None


def _placed(model, batch):
    if isinstance(batch, Placed):
        return batch.value
    placer = _PLACERS.get(model)
    return batch if placer is None else placer.place(_without_optionals(batch))


def _without_optionals(batch):
    return tf.nest.map_structure(lambda x: None if isinstance(x, tf.experimental.Optional) else x, batch)


def _on_mesh(model) -> bool:
    return model in _PLACERS


def make_function(self, step_function):
    """TensorFlowTrainer._make_function on the mesh: `steps_per_execution` placed batches per call."""
    if not _on_mesh(self):
        return _ORIGINAL["_make_function"](self, step_function)
    step = step_function
    if not self.run_eagerly:
        step = tf.function(step_function, reduce_retracing=True, jit_compile=self.jit_compile)
    model = self

    def function(iterator):
        outputs = None
        for _, batch in zip(range(model.steps_per_execution), iterator):
            outputs = step(_placed(model, batch))
        if outputs is None:
            raise StopIteration
        return outputs

    return function


def _gathered(value, mesh: dtensor.Mesh):
    """Inside the predict step: an output relaid out replicated, so that the host reads all of it."""
    if not isinstance(value, tf.Tensor):
        return value
    return dtensor.relayout(value, dtensor.Layout.replicated(mesh, value.shape.rank))


def _host(value):
    """A replicated DTensor as one ordinary tensor (its first device's copy)."""
    if isinstance(value, tf.Tensor) and dtensor.is_dtensor(value):
        return tf.identity(dtensor.unpack(value)[0])
    return value


def make_predict_function(self, force: bool = False):
    """TensorFlowTrainer.make_predict_function on the mesh: outputs gathered to host arrays."""
    if not _on_mesh(self):
        return _ORIGINAL["make_predict_function"](self, force)
    if self.predict_function is not None and not force:
        return self.predict_function
    model = self
    mesh = _PLACERS[self].mesh

    def one_step(batch):
        return tf.nest.map_structure(lambda t: _gathered(t, mesh), model.predict_step(batch))

    if not self.run_eagerly:
        one_step = tf.function(one_step, reduce_retracing=True, jit_compile=self.jit_compile)

    def predict_function(batches):
        outputs = [tf.nest.map_structure(_host, one_step(_placed(model, b))) for b in batches]
        if len(outputs) == 1:
            return outputs[0]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)

    self.predict_function = predict_function
    return predict_function


def _epoch_iterator_class():
    base = internals.trainer_module().TFEpochIterator
    epoch_iterator = internals.base_epoch_iterator_class()

    class MeshEpochIterator(base):
        """Keras's TFEpochIterator; while a model on the mesh runs, over its batches placed there."""

        def __init__(self, distribute_strategy=None, *args, **kwargs):
            if not _ACTIVE:
                super().__init__(distribute_strategy, *args, **kwargs)
                return
            epoch_iterator.__init__(self, *args, **kwargs)
            self._distribute_strategy = distribute_strategy
            self._distributed_dataset = _PlacedBatches(self.data_adapter.get_tf_dataset(), _ACTIVE[-1])

    MeshEpochIterator.__name__ = "TFEpochIterator"
    return MeshEpochIterator


def install() -> None:
    """Swaps the functions above into Keras's TensorFlow trainer (once)."""
    if _ORIGINAL:
        return
    module = internals.trainer_module()
    trainer = module.TensorFlowTrainer
    for name, function in (("_make_function", make_function), ("make_predict_function", make_predict_function)):
        _ORIGINAL[name] = getattr(trainer, name)
        setattr(trainer, name, function)
    _ORIGINAL["TFEpochIterator"] = module.TFEpochIterator
    module.TFEpochIterator = _epoch_iterator_class()
