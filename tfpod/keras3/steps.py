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
import re
import weakref

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError
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
        check_pending(model)
    finally:
        _ACTIVE.pop()
        _PENDING.pop(id(model), None)


def active_mesh() -> dtensor.Mesh | None:
    """The mesh of the model on the mesh whose fit / evaluate / predict runs now (None: none)."""
    return _ACTIVE[-1].mesh if _ACTIVE else None


def active_batch_axis() -> str | None:
    """The mesh axis batches are split over in the step running now (None: none)."""
    return _ACTIVE[-1].distribution.batch_dim_name if _ACTIVE else None


def _placed(model, batch):
    if isinstance(batch, Placed):
        return batch.value
    placer = _PLACERS.get(model)
    return batch if placer is None else placer.place(_without_optionals(batch))


def _without_optionals(batch):
    return tf.nest.map_structure(lambda x: None if isinstance(x, tf.experimental.Optional) else x, batch)


def _on_mesh(model) -> bool:
    return model in _PLACERS


_NO_LAYOUT = re.compile(r"'tf\.(\w+)' op does not implement layout propagation")
_UNEVEN = re.compile(r"splits among (\d+) values, which does not evenly divide the length of that axis \((\d+)\)")
_NOT_ON_MESH = re.compile(r"got a regular tensor for input \d+ \(shape (\[[^\]]*\])\) but was expecting a DTensor")


def _layer_named_in(model, op_name: str):
    """The outermost layer of `model` whose name is a part of the op's name scope (TensorFlow
    may add a `_1` to a scope it opened before), or None."""
    layers = {layer.name: layer for layer in internals.flatten_layers(model) if layer is not model}
    for part in op_name.split("/"):
        for name in (part, re.sub(r"_\d+$", "", part)):
            if name in layers:
                return layers[name]
    return None


def translate_error(model, error: Exception, step, batch) -> UserError | None:
    """One UserError line for DTensor's refusal of a step (None: not one of DTensor's).

    "op does not implement layout propagation" names the layer whose op it is (found in
    the traced step's graph) and what to do; a host tensor the step captured names its shape.
    """
    text = str(error)
    missing = _NO_LAYOUT.search(text)
    if missing:
        from tfpod.keras import support

        op = missing.group(1)
        where = ""
        try:
            found = support.unsupported_ops(step.get_concrete_function(batch).graph)
        except Exception:  # the trace itself is not available: the op alone is named
            found = []
        fix = support.UNSUPPORTED.get(op)
        layers = [_layer_named_in(model, name) for kind, name in found
                  if kind == op or support.UNSUPPORTED[kind] == fix]
        layer = next((l for l in layers if l is not None), None)
        if layer is not None:
            where = f"layer {layer.name!r} ({type(layer).__name__}) uses "
        fix = fix or ("replace the layer or op that uses it (docs/keras.md lists what trains under "
                      "keras.distribution)")
        return UserError(f"model {model.name!r}: {where}the op {op}, which DTensor cannot lay out "
                         f"(keras.distribution on TensorFlow): {fix}")
    uneven = _UNEVEN.search(text)
    if uneven:
        return UserError(f"model {model.name!r}: DTensor carried a split over {uneven.group(1)} devices from a split "
                         f"kernel to an activation of length {uneven.group(2)}, which it does not divide (a kernel "
                         "split by rows passes its split back to the layers before it): split that kernel by columns, "
                         "or make the sizes before it multiples of the mesh axis")
    captured = _NOT_ON_MESH.search(text)
    if captured:
        return UserError(f"model {model.name!r}: its step uses a tensor of shape {captured.group(1)} that is not on "
                         "the mesh (a constant a layer made outside the distribution): make the layer under the "
                         "distribution, or hold the value in a keras.Variable (add_weight)")
    return None


_PENDING: dict = {}  # model id -> (step, batch, outputs) of the step whose errors are not yet checked


def check_pending(model=None) -> None:
    """Raises the error of a dispatched step (of `model`, or of every model) that failed.

    A DTensor step that fails while running (not while compiling) leaves its outputs holding
    the error and the variables unchanged, and nothing raises: Keras would log zeros for a
    training that does nothing. Each step's outputs are read after the next is dispatched
    (one step stays queued), and the last at the end of the epoch.
    """
    keys = list(_PENDING) if model is None else [id(model)]
    for key in keys:
        if key not in _PENDING:
            continue
        owner, step, batch, outputs = _PENDING.pop(key)
        leaves = [t for t in tf.nest.flatten(outputs) if isinstance(t, tf.Tensor)]
        try:
            if leaves:
                leaves[0].numpy()
        except tf.errors.OpError as e:
            refusal = translate_error(owner, e, step, batch)
            raise (refusal or e) from None


def _run(model, step, batch):
    try:
        outputs = step(batch)
    except (tf.errors.UnknownError, tf.errors.UnimplementedError, tf.errors.InvalidArgumentError) as e:
        refusal = translate_error(model, e, step, batch)
        if refusal is None:
            raise
        raise refusal from None
    check_pending(model)
    _PENDING[id(model)] = (model, step, batch, outputs)
    return outputs


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
            outputs = _run(model, step, _placed(model, batch))
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
        outputs = [tf.nest.map_structure(_host, _run(model, one_step, _placed(model, b))) for b in batches]
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

        def tf_sync(self):
            super().tf_sync()
            check_pending()

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
