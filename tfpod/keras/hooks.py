"""The tf_keras hooks: a few tf_keras methods wrapped once, on import of tfpod.keras.

Each wrapper acts only on models built under a `KerasSharding` (`tfpod.sharding`)
and calls tf_keras's own method for every other model.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.keras import compile as compile_lib, support
from tfpod.keras.layout_map import KerasSharding, get_values, layout_map_lib, set_values

_ONE_STEP = weakref.WeakKeyDictionary()  # model -> {"predict_function"/"test_function": one-step function}


def install() -> None:
    """Wraps tf_keras's DVariable creation and a few Model methods, once.

    Every wrapper acts only for a KerasSharding (a model built under
    `tfpod.sharding`) and calls the original otherwise. tf_keras asks a LayoutMap
    only for a layout by path; placing needs the variable's shape to validate first,
    hence the wrapper around `_create_dvariable`.
    """
    lib = layout_map_lib()
    if getattr(lib._create_dvariable, "_tfpod", False):
        return
    create = lib._create_dvariable

    @functools.wraps(create)
    def _create_dvariable(layout_map, object_path, variable):
        if isinstance(layout_map, KerasSharding) and object_path:  # "": a random generator's state
            layout_map.place(object_path, variable)
        return create(layout_map, object_path, variable)

    _create_dvariable._tfpod = True
    lib._create_dvariable = _create_dvariable
    for name in ("_map_subclass_model_variable", "_map_functional_model_variable"):
        setattr(lib, name, _keeping_weight_order(getattr(lib, name)))

    from tf_keras.src.engine import training

    compile_fn = training.Model.compile
    signature = inspect.signature(compile_fn)

    @functools.wraps(compile_fn)
    def compile(self, *args, **kwargs):
        layout_map = getattr(self, "_layout_map", None)
        if not isinstance(layout_map, KerasSharding):
            return compile_fn(self, *args, **kwargs)
        from tf_keras.src.dtensor import lazy_variable

        bound = signature.bind(self, *args, **kwargs)
        _ONE_STEP.pop(self, None)
        # Inside `with tfpod.sharding(...)` new variables are lazy until a model maps
        # them; the optimizer's and the loss metric's must be created for real.
        with lazy_variable.disable_init_variable_creator():
            bound.arguments["optimizer"] = compile_lib.prepare_compile(
                self, layout_map, bound.arguments.get("optimizer", "rmsprop"),
                bound.arguments.get("steps_per_execution"),
            )
            for key in ("metrics", "weighted_metrics"):
                if bound.arguments.get(key) is not None:
                    bound.arguments[key] = compile_lib.mesh_metrics(bound.arguments[key], layout_map.mesh)
            return compile_fn(*bound.args, **bound.kwargs)

    compile._tfpod = True
    training.Model.compile = compile

    get_weights_fn, set_weights_fn = training.Model.get_weights, training.Model.set_weights

    @functools.wraps(get_weights_fn)
    def get_weights(self):
        if isinstance(getattr(self, "_layout_map", None), KerasSharding):
            return get_values(self.weights)
        return get_weights_fn(self)

    @functools.wraps(set_weights_fn)
    def set_weights(self, weights):
        if isinstance(getattr(self, "_layout_map", None), KerasSharding):
            return set_values(self.weights, weights)
        return set_weights_fn(self, weights)

    training.Model.get_weights, training.Model.set_weights = get_weights, set_weights

    # evaluate and predict run one step per host call on a sharded model, each with
    # its own cached one-step function:
    # - Keras's multi-step predict loop concatenates each step's outputs inside a while
    #   loop, which DTensor's SPMD expansion rejects ("'tf.WhileRegion' op result type
    #   tensor<8x4xf32> is incompatible with body result type tensor<16x4xf32>");
    # - with both the train and the test function holding a multi-step while loop,
    #   DTensor now and then failed to compile the second ("Cannot add function
    #   'while_cond' because a different function with the same name already exists",
    #   about 1 run in 12 here), so only training runs steps_per_execution steps per call.
    for method, attr in (("predict", "predict_function"), ("evaluate", "test_function")):
        setattr(training.Model, method, _one_step(getattr(training.Model, method), attr))
    for method in ("fit", "evaluate", "predict"):  # DTensor's "no layout propagation" as one line
        setattr(training.Model, method, _translating(getattr(training.Model, method)))

    call_fn, build_fn = training.Model.__call__, training.Model.build

    @functools.wraps(call_fn)
    def __call__(self, *args, **kwargs):
        layout_map = getattr(self, "_layout_map", None)
        if not self.built and isinstance(layout_map, KerasSharding):
            # tf_keras places a subclassed model's variables at its first call, then
            # runs the call with the user's inputs on the new DVariables: host tensors
            # must become (replicated) DTensors for that.
            args, kwargs = tf.nest.map_structure(lambda x: _on_mesh(x, layout_map.mesh, self.name), (args, kwargs))
            if args:
                support.record_input_spec(self, args[0])  # for compile's trace (tfpod.keras.support)
            if not _is_functional(self):
                _build_lazily(self, layout_map, args, kwargs)
            with dtensor.default_mesh(layout_map.mesh):  # tensors the call makes (an RNN's zero state) on the mesh
                return call_fn(self, *args, **kwargs)
        return call_fn(self, *args, **kwargs)

    @functools.wraps(build_fn)
    def build(self, input_shape):
        layout_map = getattr(self, "_layout_map", None)
        if self.built or not isinstance(layout_map, KerasSharding) or _is_functional(self):
            return build_fn(self, input_shape)
        # Model.build traces `call` without `__call__`, where tf_keras places the
        # variables on the mesh: call it on a batch of zeros instead.
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

    training.Model.__call__, training.Model.build = __call__, build

    # Optimizers on the mesh take dense gradients (see compile_lib.mesh_optimizer).
    from tf_keras.src.optimizers import optimizer as new_optimizer
    from tf_keras.src.optimizers.legacy import optimizer_v2

    for cls in (new_optimizer.Optimizer, optimizer_v2.OptimizerV2):
        cls.apply_gradients = _dense_gradients(cls.apply_gradients)


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
        from tf_keras.src.engine import base_layer

        layers = [model] + [o for o in model._flatten(predicate=lambda o: isinstance(o, base_layer.Layer))]
        before = {(id(layer), attr): (layer, attr, [v.name for v in getattr(layer, attr)])
                  for layer in layers for attr in ("_trainable_weights", "_non_trainable_weights")}
        out = map_variables(model, layout_map)
        for layer, attr, names in before.values():
            now = getattr(layer, attr)
            by_name = {v.name: v for v in now}
            if len(by_name) == len(now) == len(names) and set(names) == set(by_name):
                now[:] = [by_name[n] for n in names]
        return out

    return wrapper


def _translating(method):
    """Wraps Model.fit / evaluate / predict: on a sharded model, an op DTensor cannot lay out
    (found when the step compiles) is one UserError line (`support.translate`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not isinstance(getattr(self, "_layout_map", None), KerasSharding):
            return method(self, *args, **kwargs)
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
            grads_and_vars = compile_lib.densify(grads_and_vars)
        return apply_gradients(self, grads_and_vars, *args, **kwargs)

    return wrapper


def _one_step(method, attr: str):
    """Wraps Model.predict / evaluate: on a sharded model, one step per call (see install)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        spe = getattr(self, "_steps_per_execution", None)
        if not isinstance(getattr(self, "_layout_map", None), KerasSharding) or spe is None or int(spe.numpy()) == 1:
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


def _build_lazily(model, layout_map: KerasSharding, args, kwargs) -> None:
    """Builds an unbuilt subclassed model with lazy variables, then places them on the mesh.

    What tf_keras's Model.__call__ does for a model with a layout map, except that the
    symbolic inputs have the real inputs' shapes without the batch dimension and their
    dtypes: tf_keras made them Input(x.shape), one dimension too many (a Dense-only
    model did not mind; a GRU or a convolution failed to build).
    """
    from tf_keras.src.engine import base_layer, input_layer

    def symbolic(x):
        if isinstance(x, (tf.Tensor, np.ndarray)):
            x = tf.convert_to_tensor(x)
            return input_layer.Input(shape=x.shape[1:], dtype=x.dtype)
        return x

    inputs, rest, rest_kwargs = model._call_spec.split_out_first_arg(list(args), dict(kwargs))
    with layout_map_lib().layout_map_scope(layout_map):
        base_layer.Layer.__call__(model, tf.nest.map_structure(symbolic, inputs), *rest, **rest_kwargs)
    layout_map_lib()._map_subclass_model_variable(model, layout_map)


def _is_functional(model) -> bool:
    from tf_keras.src.engine import functional

    return isinstance(model, functional.Functional)


def _on_mesh(x, mesh: dtensor.Mesh, name: str):
    """A host value as a replicated DTensor (DTensors, Python scalars and None pass through)."""
    if isinstance(x, np.ndarray):
        x = tf.convert_to_tensor(x)
    if not isinstance(x, tf.Tensor):
        if type(x).__name__ == "KerasTensor":
            raise UserError(
                f"model {name!r} is called on a symbolic tf_keras.Input under tfpod.sharding: build a subclassed "
                "model by calling it on a batch (a tensor or numpy array), or with model.build(input_shape)"
            )
        return x
    if not tf.executing_eagerly() or dtensor.is_dtensor(x):
        return x
    return dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, x.shape.rank))
