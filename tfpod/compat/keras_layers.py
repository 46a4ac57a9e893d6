"""tf_keras's internals: its layer traversal, calls and builds, lazy variables and their
placement on a mesh, random generators, training state.
"""

from __future__ import annotations

import contextlib
import importlib

from tfpod import UserError


def flatten_layers(model, include_self: bool = True) -> list:
    """Every layer inside `model` (tf_keras's own traversal, nested layers included)."""
    return list(model._flatten_layers(include_self=include_self))


def flatten(model, predicate, with_path: bool = False) -> list:
    """tf.Module's traversal of `model`'s attributes: objects matching `predicate` (with paths)."""
    return list(model._flatten(predicate=predicate, with_path=with_path))


def first_paths(model, predicate) -> dict:
    """{id: (path, object)} of `flatten(model, predicate, with_path=True)`, each object
    once, at its first path, in that order.

    The walk is tf.Module's, but a module already walked whole is not walked again: a
    tf_keras layer is reachable by its attribute and by its parent's tracking lists, so
    the full walk visits a layer nested d deep about 2**d times, and every visit after
    the first finds only objects found before. (A walk cut short by a reference back
    to a module being walked is not whole: that module is walked again, as tf.Module does.)
    """
    from tensorflow.python.module import module as module_lib
    from tensorflow.python.util import nest

    found, whole = {}, set()

    def walk(module, path, stack) -> bool:
        recursive = id(module) not in stack
        submodules = []
        for key in sorted(vars(module)):
            if key in module._TF_MODULE_IGNORED_PROPERTIES:
                continue
            for leaf_path, leaf in nest.flatten_with_tuple_paths(vars(module)[key]):
                if predicate(leaf):
                    found.setdefault(id(leaf), (path + (key,) + leaf_path, leaf))
                if recursive and module_lib._is_module(leaf):
                    submodules.append((path + (key,) + leaf_path, leaf))
        stack.append(id(module))
        complete = recursive
        for sub_path, sub in submodules:
            if id(sub) not in whole:
                complete = walk(sub, sub_path, stack) and complete
        stack.pop()
        if complete:
            whole.add(id(module))
        return complete

    walk(model, (), [])
    return found


@contextlib.contextmanager
def intercepting_layer_calls(intercept):
    """Within: a tf_keras layer called in a graph (a model's symbolic build) runs
    `intercept(layer, call)(*arguments)` in place of `call(*arguments)`, inside its name
    scope and after its own `build`; when `intercept` is asked, `layer.built` still
    says whether this is the call that builds the layer."""
    layer_class = tf_keras().layers.Layer
    original = layer_class._autographed_call  # asked for the call before the layer builds
    layer_class._autographed_call = lambda self: intercept(self, original(self))
    try:
        yield
    finally:
        layer_class._autographed_call = original


@contextlib.contextmanager
def intercepting_layer_builds(intercept):
    """Within: a tf_keras layer's first build (when it is first called) runs
    `intercept(layer, inputs, build)`, where `build(inputs)` builds it for `inputs`."""
    layer_class = tf_keras().layers.Layer
    original = layer_class._maybe_build

    def maybe_build(self, inputs):
        if self.built:
            return original(self, inputs)
        return intercept(self, inputs, lambda x: original(self, x))

    layer_class._maybe_build = maybe_build
    try:
        yield
    finally:
        layer_class._maybe_build = original


def build_layer(layer, inputs) -> None:
    """Builds `layer` as its first call on `inputs` (tensors, or TensorSpecs) would."""
    layer._maybe_build(inputs)


def inner_variable(v):
    """The variable inside a mixed-precision AutoCastVariable (or `v` itself)."""
    return v._variable if type(v).__name__ == "AutoCastVariable" else v


def set_inner_variable(v, variable) -> None:
    """Replaces the variable an AutoCastVariable wraps (every reference to it then sees the new one)."""
    v._variable = variable


def wrap_variable_reads(variable, wrap) -> None:
    """Makes every read of `variable` return wrap(value) (the hook ResourceVariable reads go through)."""
    read = variable._read_variable_op

    def wrapped(*args, **kwargs):
        return wrap(read(*args, **kwargs))

    variable._read_variable_op = wrapped


def intercept_variable_reads(variable, reader) -> None:
    """Makes every read of `variable` return reader(read), where read() is the read it replaces
    (so a reader may return another tensor without creating the read op)."""
    read = variable._read_variable_op

    def intercepted(*args, **kwargs):
        return reader(lambda: read(*args, **kwargs))

    variable._read_variable_op = intercepted


def dtensor_save_spec():
    """DTensor's SaveSpec with a layout (tensorflow.dtensor.python.d_variable.DSaveSpec)."""
    from tensorflow.dtensor.python import d_variable

    return d_variable.DSaveSpec


def saveable_object_class():
    """TensorFlow's legacy SaveableObject (what a DVariable's checkpoint entry is)."""
    from tensorflow.python.training.saving import saveable_object

    return saveable_object.SaveableObject


def set_checkpoint_saveable(variable, factory) -> None:
    """Checkpoints save and restore `variable` through factory(name) -> SaveableObject (its own hook)."""
    variable._gather_saveables_for_checkpoint = lambda: {"VARIABLE_VALUE": factory}


def lazy_variable():
    """tf_keras's lazily initialized variables (tf_keras.src.dtensor.lazy_variable)."""
    return tf_keras(private="dtensor.lazy_variable")


def lazy_initial_value(variable):
    """A lazy variable's initial value (a callable or a tensor); None for others."""
    if not isinstance(variable, lazy_variable().LazyInitVariable):
        return None
    return variable._initial_value


def set_lazy_initial_value(variable, value) -> bool:
    """Makes `value` a lazy variable's initial value (placed with it); False, nothing done, for others."""
    if not isinstance(variable, lazy_variable().LazyInitVariable):
        return False
    variable._initial_value = value
    return True


def layout_map_lib():
    """tf_keras's DTensor layout map module (LayoutMap, the variable mapping functions)."""
    return tf_keras(private="dtensor.layout_map")


def wrap_create_dvariable(wrap) -> None:
    """Replaces tf_keras's lazy-variable -> DVariable function by wrap(original), once."""
    lib = layout_map_lib()
    if not getattr(lib._create_dvariable, "_tfpod", False):
        lib._create_dvariable = wrap(lib._create_dvariable)
        lib._create_dvariable._tfpod = True


def wrap_variable_mapping(wrap) -> None:
    """Replaces tf_keras's two functions placing a model's lazy variables by wrap(original), once."""
    lib = layout_map_lib()
    for name in ("_map_subclass_model_variable", "_map_functional_model_variable"):
        if not getattr(getattr(lib, name), "_tfpod", False):
            setattr(lib, name, wrap(getattr(lib, name)))
            getattr(lib, name)._tfpod = True


def place_model_variables(model, layout_map) -> None:
    """Re-creates a lazily built subclassed model's variables as DVariables laid out by `layout_map`."""
    layout_map_lib()._map_subclass_model_variable(model, layout_map)


def create_dvariable(layout_map, path: str, variable):
    """One lazy variable as a DVariable with the layout `layout_map` gives `path`."""
    return layout_map_lib()._create_dvariable(layout_map, path, variable)


def layout_map_of(model):
    """The LayoutMap a model was built under (None: none)."""
    return getattr(model, "_layout_map", None)


def set_layout_map(model, layout_map) -> None:
    """Marks `model` as built under `layout_map` (Keras-created counters then become DVariables)."""
    model._layout_map = layout_map


def is_functional(model) -> bool:
    return isinstance(model, tf_keras(private="engine.functional").Functional)


def split_first_argument(model, args, kwargs):
    """(inputs, other args, other kwargs) of a call of `model`, as tf_keras splits them."""
    return model._call_spec.split_out_first_arg(list(args), dict(kwargs))


def causal_padding(layer, inputs):
    """The padding a Keras convolution with padding='causal' applies to `inputs`."""
    return layer._compute_causal_padding(inputs)


def unfuse_normalization(layer) -> bool:
    """Switches a Keras layer or batch normalization to its unfused ops; returns whether it was fused."""
    from tf_keras.src.layers.normalization import batch_normalization

    if isinstance(layer, tf_keras().layers.LayerNormalization) and getattr(layer, "_fused", False):
        layer._fused = False
        return True
    if isinstance(layer, batch_normalization.BatchNormalizationBase) and getattr(layer, "fused", False):
        layer.fused = False
        return True
    return False


def normalization_inputs(layer, inputs):
    """A Keras Normalization's inputs as its `call` takes them (a tensor, cast to its dtype)."""
    return layer._standardize_inputs(inputs)


def normalization_shapes(layer) -> tuple[list, list]:
    """A built Keras Normalization's (the shape its mean and variance broadcast in, the axes it keeps)."""
    return layer._broadcast_shape, layer._keep_axis


def training_value(layer, training):
    """A Keras layer's effective `training` flag for a call."""
    return layer._get_training_value(training)


def assign_moving_average(layer, variable, value, momentum) -> None:
    """Keras BatchNormalization's moving-average update of `variable` toward `value`."""
    layer._assign_moving_average(variable, value, momentum, None)


def stateless_dropout_generator(layer, seed_fn, dropout_fn) -> bool:
    """Makes a Keras layer's random generator stateless, seeded by `seed_fn()`, with `dropout_fn`
    as its dropout. Returns False when the layer has no tf_keras random generator."""
    from tf_keras.src import backend

    gen = getattr(layer, "_random_generator", None)
    if not isinstance(gen, backend.RandomGenerator):
        return False
    gen._rng_type, gen._generator, gen._built = gen.RNG_STATELESS, None, True
    gen.make_seed_for_stateless_op = seed_fn
    gen.dropout = dropout_fn
    return True


def stateless_seed(dropout):
    """The [2] seed a Keras dropout layer's stateless generator gives its next mask, or None
    (no layer, or one without a stateless generator: Keras's legacy stateful dropout)."""
    generator = getattr(dropout, "_random_generator", None)
    make = getattr(generator, "make_seed_for_stateless_op", None)
    return make() if make is not None else None


def check_replayable_dropout(layer, what: str) -> None:
    """Raises UserError when a dropout layer inside `layer` draws from Keras's stateful
    generator (a recomputed block would then drop other units than its forward pass)."""
    import tf_keras
    from tf_keras.src import backend

    for inner in flatten_layers(layer):
        gen = getattr(inner, "_random_generator", None)
        if isinstance(inner, tf_keras.layers.Dropout) and isinstance(gen, backend.RandomGenerator) and \
                gen._rng_type != gen.RNG_STATELESS:
            raise UserError(f"{what}: dropout layer {inner.name!r} draws from Keras's stateful generator, so a "
                            "recomputed block would drop other units than its forward pass; train it through tfpod's "
                            "Trainer (tfpod.partitioning.replayable_dropout makes the masks replayable) or set "
                            "remat=False")


def keras_mask(x):
    """The Keras mask a layer attached to tensor `x` ([batch, length]; None: none)."""
    return getattr(x, "_keras_mask", None)


def call_training():
    """The `training` flag of the Keras layer call being traced (for a call that takes no
    `training` argument)."""
    return tf_keras("engine.base_layer_utils").call_context().training


def set_trainable(variable, trainable: bool) -> None:
    """Sets a (lazy, placed or AutoCast-wrapped) variable's own trainable flag."""
    inner_variable(variable)._trainable = trainable


def weight_lists(layer) -> tuple[list, list]:
    """A layer's own (trainable, non-trainable) weight lists, in creation order (mutable)."""
    return layer._trainable_weights, layer._non_trainable_weights


def steps_per_execution(model):
    """A compiled model's steps_per_execution variable (None before compile)."""
    return getattr(model, "_steps_per_execution", None)


def training_state(model):
    """What Model.fit asks for the (epoch, step) to start at."""
    return model._training_state


def set_training_state(model, state) -> None:
    model._training_state = state


def no_autograph():
    """A scope in which tf_keras calls layers as written (autograph's conversion off, as in
    `tf.function(autograph=False)`; else tf_keras converts a subclassed layer's `call`)."""
    from tensorflow.python.autograph.core import ag_ctx

    return ag_ctx.ControlStatusCtx(status=ag_ctx.Status.DISABLED)


def tf_keras(private: str = ""):
    """tf_keras, or its private module tf_keras.src.<private> (e.g. "engine.training")."""
    return importlib.import_module(f"tf_keras.src.{private}" if private else "tf_keras")
