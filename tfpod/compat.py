"""The one place tfpod touches private parts of tf_keras, Model Garden and TensorFlow.

tfpod builds on internals these libraries do not promise to keep: how tf_keras makes a model's
variables lazily and places them on a mesh, optimizer slots, a layer's random generator, Model
Garden layers' one-hot switches. Every such access is a function here, written against the
versions in TESTED; importing this module checks the installed versions and stops with one line
when one differs (setup.py pins them), not later in an AttributeError deep in a library.

Public API (tf_keras.Model, tf_keras.layers.*, tf.data, dtensor) is used directly elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata

from tfpod import UserError

# distribution -> the version prefix (major.minor) the accesses below are written for
TESTED = {"tensorflow": "2.20", "tf-keras": "2.20", "tf-models-official": "2.20"}


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Raises one UserError line when an installed version differs from TESTED."""
    for dist, tested in TESTED.items():
        try:
            version = (installed or {}).get(dist) or importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise UserError(f"{dist} is not installed: tfpod needs {dist}=={tested}.*; pip install -e . installs "
                            "the tested versions") from None
        if version != tested and not version.startswith(tested + "."):
            raise UserError(f"{dist} {version} is installed, but tfpod is written against {dist} {tested}.x (it uses "
                            f"internals that change between versions): pip install '{dist}=={tested}.*' (pip install -e "
                            ". pins the tested versions)")


check_versions()


# ---------------------------------------------------------------------------
# tf_keras: layers and variables


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


# ---------------------------------------------------------------------------
# tf_keras: optimizers and metrics


def decayed_lr(optimizer):
    """A legacy (Model Garden) optimizer's learning rate at its current step (a tensor)."""
    import tensorflow as tf

    return optimizer._decayed_lr(tf.float32)


def legacy_optimizer_class():
    """tf_keras's legacy OptimizerV2 (Model Garden's optimizers subclass it)."""
    return tf_keras().optimizers.legacy.Optimizer


def create_optimizer_weights(optimizer) -> None:
    """A legacy optimizer's step counter and hyperparameters, created now."""
    optimizer._create_all_weights([])


def create_slots(optimizer, variable) -> None:
    """A legacy optimizer's slots of `variable`, created now."""
    optimizer._create_slots([variable])


def prepare_updates(optimizer, variables) -> dict:
    """A legacy optimizer's per-step coefficients (learning rate, beta powers, ...) for these
    variables: its `apply_state`."""
    return optimizer._prepare(list(variables))


def apply_updates(optimizer, grads_and_vars, apply_state: dict):
    """A legacy optimizer's dense updates of (gradient, variable) pairs with coefficients from
    `prepare_updates`, its step counter not advanced: OptimizerV2._distributed_apply without
    the increment (the caller advances it once after updating every pipeline stage's weights)."""
    import tensorflow as tf

    kwargs = {"apply_state": apply_state} if "apply_state" in optimizer._dense_apply_args else {}
    return tf.group([optimizer._resource_apply_dense(g, v, **kwargs) for g, v in grads_and_vars])


def optimizer_scalars(optimizer) -> list:
    """A legacy optimizer's step counter and hyperparameter variables (its state other than slots)."""
    import tensorflow as tf

    return [optimizer.iterations] + [h for h in optimizer._hyper.values() if isinstance(h, tf.Variable)]


def slot_table(optimizer) -> dict:
    """A legacy optimizer's {variable key: {slot name: slot}} (mutable: it is the optimizer's own)."""
    return optimizer._slots


def var_key(variable) -> str:
    """The key a legacy optimizer files `variable`'s slots under."""
    return tf_keras(private="optimizers.legacy.optimizer_v2")._var_key(variable)


def adam_coefficients(optimizer, variable, apply_state):
    """(learning rate, {beta_1_t, beta_2_t, beta_1_power, beta_2_power, epsilon, weight_decay_rate})
    of Model Garden's AdamWeightDecay for one variable's update at the current step."""
    key = (variable.device, variable.dtype.base_dtype)
    lr, _ = optimizer._get_lr(variable.device, variable.dtype.base_dtype, apply_state)
    return lr, (apply_state or {}).get(key) or optimizer._fallback_apply_state(*key)


def uses_weight_decay(optimizer, name: str) -> bool:
    """Whether Model Garden's AdamWeightDecay decays the variable named `name`."""
    return optimizer._do_use_weight_decay(name)


def legacy_has_state(optimizer) -> bool:
    return bool(optimizer._slots or optimizer._hypers_created)


def optimizer_built(optimizer) -> bool:
    """Whether a tf_keras (new) optimizer has made its slots."""
    return getattr(optimizer, "_built", False)


def optimizer_mesh(optimizer):
    """The mesh a tf_keras (new) optimizer was made for (None: none)."""
    return getattr(optimizer, "_mesh", None)


def new_on_mesh(cls, config: dict, mesh):
    """An object of a tf_keras class that takes `mesh=` only through its private attribute
    (metrics), made from `config` with the mesh set before its variables."""
    obj = cls.__new__(cls)
    object.__setattr__(obj, "_mesh", mesh)
    obj.__init__(**config)
    return obj


# ---------------------------------------------------------------------------
# Model Garden layers


def set_one_hot(embedding, on: bool) -> None:
    """Model Garden's OnDeviceEmbedding: look up by a one-hot matmul (True) or a gather."""
    embedding._use_one_hot = on


def position_embeddings(layer):
    """Model Garden's PositionEmbedding table [max_length, width]."""
    return layer._position_embeddings


def transformer_layers(encoder) -> list:
    """Model Garden's BertEncoderV2 blocks."""
    return encoder._transformer_layers


def set_transformer_layers(encoder, layers: list) -> None:
    encoder._transformer_layers = layers


def encoder_embeddings(encoder, word_ids, type_ids, training):
    """BertEncoderV2's input to its first block [batch, length, hidden]: word, position and
    type embeddings, their layer norm, dropout (and projection), as its `call` makes them."""
    x = encoder._get_embeddings(word_ids, type_ids, encoder._embedding_layer(word_ids), None, None)
    x = encoder._embedding_dropout(encoder._embedding_norm_layer(x), training=training)
    return x if encoder._embedding_projection is None else encoder._embedding_projection(x)


def encoder_attention_mask(encoder, like, input_mask):
    """BertEncoderV2's attention mask [batch, length, length] of input_mask, in `like`'s dtype."""
    return encoder._attention_mask_layer(like, input_mask)


def encoder_input_layers(encoder) -> list:
    """BertEncoderV2's layers that run before its blocks (their weights: the first pipeline stage's)."""
    return [layer for layer in (encoder._embedding_layer, encoder._position_embedding_layer,
                                encoder._type_embedding_layer, encoder._embedding_norm_layer,
                                encoder._embedding_projection) if layer is not None]


def rename_layer(layer, name: str) -> None:
    """Sets a built-in layer's name (variable names, hence rule paths, follow it)."""
    layer._name = name


def set_embedding_initializer(embedding, initializer) -> None:
    """Model Garden's OnDeviceEmbedding: the initializer its table is made with (before it builds)."""
    embedding._initializer = initializer


# ---------------------------------------------------------------------------
# TensorFlow


def checkpoint_objects(ckpt) -> dict:
    """{checkpoint key: variable} of every variable a tf.train.Checkpoint saves (slots included)."""
    import tensorflow as tf
    from tensorflow.python.checkpoint import graph_view, util

    objects, _, _, _, names = util.objects_ids_and_slot_variables_and_paths(graph_view.ObjectGraphView(ckpt))
    return {f"{names[o]}/.ATTRIBUTES/VARIABLE_VALUE": o for o in objects if isinstance(o, tf.Variable)}


def bound_objects(status) -> list:
    """The objects a restore (its CheckpointLoadStatus) gave values from the checkpoint."""
    return list(status._checkpoint.object_by_proto_id.values())


def checkpoint_object_graph(ckpt) -> bytes:
    """The serialized object graph (TrackableObjectGraph) a save of `ckpt` writes beside its variables."""
    from tensorflow.python.checkpoint import graph_view, save_util

    return save_util.serialize_graph_view(graph_view.ObjectGraphView(ckpt))[3].SerializeToString()


def record_checkpoint(manager, path: str) -> None:
    """Records checkpoint `path`, written by other means, in a tf.train.CheckpointManager: it
    becomes the newest in the `checkpoint` state file and the oldest beyond max_to_keep are
    deleted (what the manager's own save does once its files are written)."""
    import time

    manager._maybe_delete.pop(path, None)
    manager._maybe_delete[path] = time.time()
    manager._latest_checkpoint = path
    manager._record_state()
    manager._sweep()
    manager._record_state()


def onednn_enabled() -> bool:
    """Whether TensorFlow runs oneDNN CPU kernels (else Eigen's): only with AVX-512, not with TF_ENABLE_ONEDNN_OPTS=0."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def share_variable_handle_programs() -> None:
    """Eager variable handles without TensorFlow's per-variable `debug_name` (graph ones keep it):
    DTensor compiles an eager op once per set of attributes, so a name per VarHandleOp cost one
    program per variable (21 ms each on 8 CPU devices against 3 ms reused; gpt's 110 variables
    and slots took 2.3 s). The variables keep their names (Python-side)."""
    from tensorflow.python.eager import context
    from tensorflow.python.ops import gen_resource_variable_ops as ops

    make = ops.var_handle_op
    if getattr(make, "tfpod_shared", False):
        return

    def var_handle_op(*args, **kwargs):
        if context.executing_eagerly():
            kwargs["debug_name"], kwargs["name"] = "", None
        return make(*args, **kwargs)

    var_handle_op.tfpod_shared = True
    ops.var_handle_op = var_handle_op


def unary_dataset_base():
    """tf.data's base class of a dataset that wraps another with the same structure."""
    from tensorflow.python.data.ops import dataset_ops

    return dataset_ops.UnaryUnchangedStructureDataset


def variant_tensor(dataset):
    return dataset._variant_tensor


def iterator_resource(iterator):  # (tf.data's iterator resource)
    return iterator._iterator_resource


def dtensor_iterator_base():
    """DTensor's iterator over per-device iterators (what DTensorDataset iterates with)."""
    from tensorflow.dtensor.python import input_util

    return input_util._DTensorIterator


def set_iterator_element_layouts(packed_resource, layouts) -> None:
    """Tells DTensor the layouts of the elements a packed iterator resource yields."""
    from tensorflow.dtensor.python import api

    api._dtensor_device().set_iterator_element_layouts(packed_resource, layouts)


def pack_resources(resources, layout):
    """Per-device resources (iterators) as one DTensor resource."""
    from tensorflow.dtensor.python import api

    return api.pack(resources, layout)


# ---------------------------------------------------------------------------
# sacrebleu


def bleu_sentence_statistics(bleu, hypotheses: list[str], references: list[str]):
    """sacrebleu's per-sentence BLEU sufficient statistics (what BLEU.corpus_score sums)."""
    return bleu._extract_corpus_statistics(hypotheses, [references])
