"""The tf_keras hooks: a few tf_keras methods wrapped once, on import of tfpod.keras.

Each wrapper acts only on models built under a `KerasSharding` (`tfpod.sharding`) and
calls tf_keras's own method for every other model:

  variable creation   each lazy variable is validated against the rules as it is placed
                      (`KerasSharding.place`), and every layer keeps its weights in
                      creation order
  Model.compile       checks and conversions (tfpod.keras.compile)
  Model.__call__      traced with the sharding's attention (`attention=`, tfpod.attention.using);
                      an unbuilt subclassed model: built lazily with the batch's shapes,
                      placed, then called on the mesh; Model.build calls it on zeros;
                      a nested model called on tf_keras.Input tensors (a Sequential in a
                      functional model, as ConvNeXt's stem): Keras's own functional call
  Normalization()     made under tfpod.sharding: a tfpod.keras.layers.Normalization
  Model.get_weights / set_weights   gathered to / scattered from host arrays
  Model.save          the unsharded copy's files (tfpod.keras.export), traced with the sharding's attention
  Model.evaluate / predict          one step per host call; predict's outputs gathered
  Model.fit / evaluate / predict    DTensor's "no layout propagation" as one line
  Optimizer.apply_gradients         dense gradients for an optimizer on the mesh (an embedding
                                    table's rows taken out first: tfpod.keras.tables)
  Model.make_*_function             a model with embedding tables split by rows: tfpod.keras.tables
"""

from __future__ import annotations

import functools
import inspect
import weakref

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tfpod import UserError, attention, compat
from tfpod.keras import compile as compile_lib, export, layers, support, tables
from tfpod.keras.layout_map import KerasSharding, get_values, in_scope, set_values

_ONE_STEP = weakref.WeakKeyDictionary()  # model -> {"predict_function"/"test_function": one-step function}
_INSTALLED = []


def _sharding_of(model) -> KerasSharding | None:
    layout_map = compat.layout_map_of(model)
    return layout_map if isinstance(layout_map, KerasSharding) else None


def install() -> None:
    """Wraps tf_keras's variable placement and the Model and Optimizer methods above, once."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    compat.wrap_create_dvariable(_placing)
    compat.wrap_variable_mapping(_keeping_weight_order)
    model = tf_keras.Model
    model.compile = _compiling(model.compile)
    model.get_weights = _on_sharded(model.get_weights, lambda self: get_values(self.weights))
    model.set_weights = _on_sharded(model.set_weights, lambda self, weights: set_values(self.weights, weights))
    model.save = _on_sharded(model.save, _attending(export.save))  # an ordinary model's files, loadable without tfpod
    # evaluate and predict run one step per host call on a sharded model, each with
    # its own cached one-step function:
    # - Keras's multi-step predict loop concatenates each step's outputs inside a while
    #   loop, which DTensor's SPMD expansion rejects ("'tf.WhileRegion' op result type
    #   tensor<8x4xf32> is incompatible with body result type tensor<16x4xf32>");
    # - with both the train and the test function holding a multi-step while loop,
    #   DTensor now and then failed to compile the second ("Cannot add function
    #   'while_cond' because a different function with the same name already exists",
    #   about 1 run in 12 here), so only training runs steps_per_execution steps per call.
    model.predict = _one_step(model.predict, "predict_function")
    training = compat.tf_keras("engine.training")  # predict joins its batches' outputs with this
    training.potentially_ragged_concat = _gathered(training.potentially_ragged_concat)
    model.evaluate = _one_step(model.evaluate, "test_function")
    for method in ("fit", "evaluate", "predict"):
        setattr(model, method, _translating(getattr(model, method)))
    model.__call__ = _calling(model.__call__)
    model.build = _building(model.build)
    normalization = tf_keras.layers.Normalization
    normalization.__init__ = _normalization_init(normalization.__init__)
    for cls in (tf_keras.optimizers.Optimizer, compat.legacy_optimizer_class()):
        cls.apply_gradients = _dense_gradients(cls.apply_gradients)
    for kind in ("train", "test", "predict"):
        name = f"make_{kind}_function"
        setattr(model, name, _table_steps(getattr(model, name), kind))


def _placing(create):
    """tf_keras's lazy -> DVariable function, validating each variable against the rules first
    (tf_keras asks a LayoutMap only for a layout by path; checking needs the shape)."""

    @functools.wraps(create)
    def wrapper(layout_map, object_path, variable):
        if isinstance(layout_map, KerasSharding) and object_path:  # "": a random generator's state
            layout_map.place(object_path, variable)
        return create(layout_map, object_path, variable)

    return wrapper


def _keeping_weight_order(map_variables):
    """Wraps tf_keras's mapping of a model's lazy variables to DVariables so that every
    layer keeps its weights in creation order.

    tf_keras assigns the new variables by attribute path in sorted order, and a layer's
    attribute assignment re-appends the variable to its weight list: a Mean metric's
    [total, count] became [count, total], so get_weights / set_weights between a sharded
    and an unsharded model swapped them.
    """

    @functools.wraps(map_variables)
    def wrapper(model, layout_map):
        if not isinstance(layout_map, KerasSharding):
            return map_variables(model, layout_map)
        layers = [model] + compat.flatten(model, lambda o: isinstance(o, tf_keras.layers.Layer))
        before = {(id(layer), i): (layer, i, [v.name for v in weights]) for layer in layers
                  for i, weights in enumerate(compat.weight_lists(layer))}
        out = map_variables(model, layout_map)
        for layer, i, names in before.values():
            now = compat.weight_lists(layer)[i]
            by_name = {v.name: v for v in now}
            if len(by_name) == len(now) == len(names) and set(names) == set(by_name):
                now[:] = [by_name[n] for n in names]
        return out

    return wrapper


def _compiling(compile_fn):
    signature = inspect.signature(compile_fn)

    @functools.wraps(compile_fn)
    def compile(self, *args, **kwargs):
        layout_map = _sharding_of(self)
        if layout_map is None:
            return compile_fn(self, *args, **kwargs)
        _outside_the_scope(self, "compile")
        bound = signature.bind(self, *args, **kwargs)
        _ONE_STEP.pop(self, None)
        # Inside `with tfpod.sharding(...)` new variables are lazy until a model maps
        # them; the optimizer's and the loss metric's must be created for real.
        with compat.lazy_variable().disable_init_variable_creator():
            bound.arguments["optimizer"] = compile_lib.prepare_compile(
                self, layout_map, bound.arguments.get("optimizer", "rmsprop"),
                bound.arguments.get("steps_per_execution"),
            )
            for key in ("metrics", "weighted_metrics"):
                if bound.arguments.get(key) is not None:
                    bound.arguments[key] = compile_lib.mesh_metrics(bound.arguments[key], layout_map.mesh)
            out = compile_fn(*bound.args, **bound.kwargs)
            tables.attach(self, self.optimizer, layout_map)  # tables split by rows: sparse lookups and updates
            return out

    return compile


def _on_sharded(method, replacement):
    """`method`, or `replacement` for a model built under a KerasSharding."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        return (replacement if _sharding_of(self) is not None else method)(self, *args, **kwargs)

    return wrapper


def _attending(method):
    """`method` of a sharded model, traced with its sharding's attention (tfpod.attention.using)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with attention.using(_sharding_of(self).attention):
            return method(self, *args, **kwargs)

    return wrapper


def _one_step(method, attr: str):
    """Wraps Model.predict / evaluate: on a sharded model, one step per call (see install)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        spe = compat.steps_per_execution(self)
        if _sharding_of(self) is None or spe is None or int(spe.numpy()) == 1:
            return method(self, *args, **kwargs)
        value, keras_function = int(spe.numpy()), getattr(self, attr)
        cache = _ONE_STEP.setdefault(self, {})
        spe.assign(1)
        setattr(self, attr, cache.get(attr))
        try:
            result = method(self, *args, **kwargs)
            cache[attr] = getattr(self, attr)
            return result
        finally:
            spe.assign(value)
            setattr(self, attr, keras_function)

    return wrapper


def _gathered(concat):
    """tf_keras's join of predict's batch outputs, gathered when it is a DTensor split over a
    mesh axis: a single batch's output came back as it was, and Keras's conversion to NumPy
    then failed ("Trying to copy a non-single-device and non-replicated DTensor")."""

    @functools.wraps(concat)
    def wrapper(tensors):
        out = concat(tensors)
        if isinstance(out, tf.Tensor) and dtensor.is_dtensor(out):
            layout = dtensor.fetch_layout(out)
            if not layout.is_fully_replicated():
                out = dtensor.relayout(out, dtensor.Layout.replicated(layout.mesh, layout.rank))
        return out

    return wrapper


def _outside_the_scope(model, what: str) -> None:
    """Refuses compile / fit / evaluate / predict inside `with tfpod.sharding(...)`: the optimizer's
    slots made in the first step would be tf_keras's lazy variables there, which the step reads as
    empty ("Dimensions must be equal, but are 2 and 0" at SGD's momentum)."""
    if in_scope():
        raise UserError(f"model {model.name!r}: {what} called inside `with tfpod.sharding(...)`: build the model "
                        f"inside the block, and compile, fit, evaluate and predict after it")


def _translating(method):
    """Wraps Model.fit / evaluate / predict: on a sharded model, an op DTensor cannot lay out
    (found when the step compiles) is one UserError line (`support.translate`); called inside
    `with tfpod.sharding(...)`, it is refused (`_outside_the_scope`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if _sharding_of(self) is None:
            return method(self, *args, **kwargs)
        _outside_the_scope(self, method.__name__)
        try:
            return method(self, *args, **kwargs)
        except tf.errors.OpError as e:
            translated = support.translate(e, self.name)
            if translated is None:
                raise
            raise translated from None

    return wrapper


def _dense_gradients(apply_gradients):
    """Wraps Optimizer.apply_gradients: dense gradients for an optimizer made by mesh_optimizer."""

    @functools.wraps(apply_gradients)
    def wrapper(self, grads_and_vars, *args, **kwargs):
        if getattr(self, "_tfpod_dense_gradients", False):
            grads_and_vars = compile_lib.densify(tables.take_rows(self, grads_and_vars))
        return apply_gradients(self, grads_and_vars, *args, **kwargs)

    return wrapper


def _table_steps(make_function, kind: str):
    """Model.make_{train,test,predict}_function: a model with embedding tables split by rows
    runs its steps through tfpod.keras.tables (each step's lookups, and in training its
    sparse updates, around Keras's own step)."""
    attr = f"{kind}_function"

    @functools.wraps(make_function)
    def wrapper(self, force=False):
        if not tables.has_tables(self):
            return make_function(self, force)
        if getattr(self, attr) is None or force:
            setattr(self, attr, tables.make_function(self, kind))
        return getattr(self, attr)

    return wrapper


def _calling(call_fn):
    """Model.__call__ of a model under a KerasSharding: traced with the sharding's attention
    (every step fit, evaluate, predict and compile's checks trace calls it); an unbuilt
    subclassed one is built lazily with the batch's shapes and placed, then the call runs on
    the mesh (host inputs replicated DTensors, tensors the call makes, such as an RNN's zero
    state, on the mesh)."""

    @functools.wraps(call_fn)
    def __call__(self, *args, **kwargs):
        layout_map = _sharding_of(self)
        if layout_map is None:
            return call_fn(self, *args, **kwargs)
        with attention.using(layout_map.attention):
            return _call_on_mesh(call_fn, self, layout_map, args, kwargs)

    return __call__


def _call_on_mesh(call_fn, self, layout_map: KerasSharding, args, kwargs):
    """A sharded model's call (see `_calling`)."""
    if self.built:
        return call_fn(self, *args, **kwargs)
    if _symbolic(args, kwargs):  # nested in a functional model, which places the variables
        with compat.layout_map_lib().layout_map_scope(layout_map):  # (tf_keras's own call drops Inputs)
            return tf_keras.layers.Layer.__call__(self, *args, **kwargs)
    args, kwargs = tf.nest.map_structure(lambda x: _on_mesh(x, layout_map.mesh, self.name), (args, kwargs))
    if args:
        support.record_input_spec(self, args[0])  # for compile's trace (tfpod.keras.support)
    if not compat.is_functional(self):
        _build_lazily(self, layout_map, args, kwargs)
    with dtensor.default_mesh(layout_map.mesh):
        return call_fn(self, *args, **kwargs)


def _normalization_init(init_fn):
    """Normalization made under tfpod.sharding: a tfpod.keras.layers.Normalization (Keras's build
    reads its variables before they hold values). Swapped when made, since Keras takes the
    `call` of the first (symbolic) call before it builds the layer."""

    @functools.wraps(init_fn)
    def __init__(self, *args, **kwargs):
        init_fn(self, *args, **kwargs)
        if type(self) is tf_keras.layers.Normalization and in_scope():
            self.__class__ = layers.Normalization

    return __init__


def _building(build_fn):
    """Model.build of an unbuilt subclassed model under a KerasSharding: a call on a batch of zeros
    (tf_keras's build traces `call` without `__call__`, where the variables are placed)."""

    @functools.wraps(build_fn)
    def build(self, input_shape):
        if self.built or _sharding_of(self) is None or compat.is_functional(self):
            return build_fn(self, input_shape)

        def zeros(shape):
            dims = tf.TensorShape(shape).as_list()
            if any(d is None for d in dims[1:]):
                raise UserError(
                    f"model {self.name!r}: build(input_shape={input_shape}) needs every dimension but the batch; "
                    "give them, or call the model on a batch instead"
                )
            return tf.zeros([1] + dims[1:], self.compute_dtype if dims else None)

        is_shape = lambda s: isinstance(s, tf.TensorShape) or (
            isinstance(s, (tuple, list)) and all(d is None or isinstance(d, int) for d in s))
        if is_shape(input_shape):
            inputs = zeros(input_shape)
        elif isinstance(input_shape, dict):
            inputs = {k: zeros(v) for k, v in input_shape.items()}
        else:
            inputs = [zeros(v) for v in input_shape]
        self(inputs)

    return build


def _build_lazily(model, layout_map: KerasSharding, args, kwargs) -> None:
    """Builds an unbuilt subclassed model with lazy variables, then places them on the mesh.

    What tf_keras's Model.__call__ does for a model with a layout map, except that the
    symbolic inputs have the real inputs' shapes without the batch dimension and their
    dtypes: tf_keras made them Input(x.shape), one dimension too many (a Dense-only
    model did not mind; a GRU or a convolution failed to build).
    """

    def symbolic(x):
        if isinstance(x, (tf.Tensor, np.ndarray)):
            x = tf.convert_to_tensor(x)
            return tf_keras.Input(shape=x.shape[1:], dtype=x.dtype)
        return x

    inputs, rest, rest_kwargs = compat.split_first_argument(model, args, kwargs)
    with compat.layout_map_lib().layout_map_scope(layout_map):
        tf_keras.layers.Layer.__call__(model, tf.nest.map_structure(symbolic, inputs), *rest, **rest_kwargs)
    compat.place_model_variables(model, layout_map)


def _symbolic(args, kwargs) -> bool:
    """Whether a call's inputs are tf_keras.Input tensors (a model nested in a functional one)."""
    return any(type(x).__name__ == "KerasTensor" for x in tf.nest.flatten((args, kwargs)))


def _on_mesh(x, mesh: dtensor.Mesh, name: str):
    """A host value as a replicated DTensor (DTensors, Python scalars and None pass through)."""
    if isinstance(x, np.ndarray):
        x = tf.convert_to_tensor(x)
    if not isinstance(x, tf.Tensor):
        return x
    if not tf.executing_eagerly() or dtensor.is_dtensor(x):
        return x
    return dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, x.shape.rank))
