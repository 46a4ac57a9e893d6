"""Keras `fit` on the mesh: a user's own tf_keras model, trained sharded.

    mesh = tfpod.make_mesh("data:-1,model:2")
    with tfpod.sharding(mesh, rules={r"d1\\.kernel": (None, "mlp"), r"d2\\.kernel": ("mlp", None)}):
        model = build_my_model()                   # functional, or subclassed and called once
    model.compile(optimizer="adam", loss=..., metrics=[...], steps_per_execution=4)
    model.fit(tfpod.input.to_mesh(train_ds, mesh), epochs=3,
              validation_data=tfpod.input.to_mesh(eval_ds, mesh),
              callbacks=[tfpod.keras.Checkpoint(model_dir), tf_keras.callbacks.EarlyStopping()])

How it fits together, and why:

* Variables. tf_keras already turns the variables of a model built under a
  `LayoutMap` into DVariables: every variable is first created lazily, and once the
  model's object paths are final (at the end of a functional model's constructor, at
  a subclassed model's first call) each one is re-created as a DVariable with the
  layout its path maps to. `KerasSharding` is such a LayoutMap whose layouts come
  from tfpod's rules engine instead of first-match regexes: a rule gives a path regex
  (`re.fullmatch` on paths such as `d1.kernel` or `blocks.0.ffn.kernel`) logical axes
  (mapped to mesh axes by the preset's table, as in main.py) or mesh axes directly.
  Each variable is validated as it is placed, before it is allocated, with
  `tfpod.sharding.resolve`, so a rank mismatch, a dimension that does not divide
  over its mesh axis or a variable matched by two rules stop with main.py's one-line
  UserError. A variable no rule matches is replicated (or, with `cover_all=True`,
  is an error). Initial values are computed replicated and then relaid out, so they
  do not depend on the mesh (a functional model gets the unsharded model's values
  for the same seed; a subclassed one draws them in object-path order instead).
* tf_keras hooks. A few tf_keras methods are wrapped once, on first use of
  `tfpod.sharding`; each acts only on models built under a KerasSharding and leaves
  every other model alone:
  - `Model.compile` checks that the model is built, that every weight is on the mesh
    and every rule matched a variable, logs the layout report, switches layer and
    batch normalization to their unfused ops (DTensor cannot lay out
    FusedBatchNormV3), puts metric objects' state on the mesh, and converts the
    optimizer (see `mesh_optimizer`): tf_keras's training loop already runs on
    DTensor when the model has a layout map, but its optimizer must be a DTensor one;
  - `Model.__call__` / `Model.build` of an unbuilt subclassed model: the first call
    places the variables and then runs on them, so host inputs become replicated
    DTensors (tf_keras passes them on as they are and the call fails), and `build`
    calls the model on zeros (tf_keras's `build` never places the variables);
  - `Model.get_weights` / `set_weights` gather to / scatter from host arrays
    (`.numpy()` of a split DTensor fails), so EarlyStopping(restore_best_weights)
    and weight copies work;
  - `Model.evaluate` / `predict` run one step per host call (see `_install`).
* Input. `to_mesh` turns a tf.data.Dataset of global batches into one whose
  iterator yields batch-sharded DTensors (each device reads its own rows through its
  own tf.data iterator; the iterators are packed into one DTensor iterator, as
  `dtensor.DTensorDataset` does). Unlike a DTensorDataset it is a plain (not
  "distributed") dataset to Keras: fit re-iterates it every epoch and reads its
  number of steps from its cardinality, so `steps_per_epoch` is not needed.
* Checkpoints. `Checkpoint` saves the model and optimizer through
  tfpod.checkpoint.CheckpointManager (`model_dir/checkpoints/ckpt-<step>`, only
  complete checkpoints resumed, the newest `keep` kept) and resumes the next fit at
  the saved step: the optimizer's step counter, then the epoch and step within it.

Not supported: mixed-precision policies (AutoCastVariables are not placed),
`steps_per_execution='auto'`, `class_weight` with a MeshDataset, sparse or ragged
inputs, SavedModel / `model.save` of the sharded model (DTensor layouts are not
saved: export from an unsharded copy via `get_weights`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Mapping

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tfpod import UserError, checkpoint as checkpointlib, fused
from tfpod import sharding as shardinglib

log = logging.getLogger("tfpod")

__all__ = ["KerasSharding", "sharding", "to_mesh", "MeshDataset", "Checkpoint", "layout_of", "get_values",
           "set_values", "mesh_optimizer"]


# ---------------------------------------------------------------------------
# Rules -> layouts for tf_keras variables


class _MeshAxisRule(shardinglib.AxisRule):
    """An AxisRule some of whose entries are mesh axes (checked against the mesh by the parser)."""

    def __post_init__(self):
        pass


def _parse_rules(rules, mesh: dtensor.Mesh) -> list[shardinglib.AxisRule]:
    """User rules -> AxisRules. Each entry is a logical axis, a mesh axis of `mesh`, or None."""
    if rules is None:
        return []
    if isinstance(rules, Mapping):
        items = list(rules.items())
    else:
        items = []
        for r in rules:
            if isinstance(r, shardinglib.AxisRule):
                items.append((r.pattern, r.axes))
            elif isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str):
                items.append((r[0], r[1]))
            else:
                raise UserError(
                    f"sharding rule {r!r} is not (regex, axes): give rules as a dict "
                    "{regex: axes} or a list of (regex, axes), axes one per dimension, e.g. (None, 'mlp')"
                )
    parsed = []
    mesh_axes = [a for a in mesh.dim_names if a not in shardinglib.LOGICAL_AXES]
    for pattern, axes in items:
        if isinstance(axes, str) or axes is None:
            axes = (axes,)
        axes = tuple(axes)
        shardinglib.AxisRule(pattern, ())  # the regex check and its message
        for a in axes:
            if a is not None and a not in shardinglib.LOGICAL_AXES and a not in mesh_axes:
                raise UserError(
                    f"sharding rule {pattern!r}: unknown axis {a!r}; use a logical axis "
                    f"({', '.join(shardinglib.LOGICAL_AXES)}), a mesh axis of this mesh "
                    f"({', '.join(mesh.dim_names)}) or None"
                )
        if all(a is None or a in shardinglib.LOGICAL_AXES for a in axes):
            parsed.append(shardinglib.AxisRule(pattern, axes))
        else:
            parsed.append(_MeshAxisRule(pattern, axes))
    return parsed


def _layout_map_lib():
    from tf_keras.src.dtensor import layout_map

    return layout_map


class KerasSharding(_layout_map_lib().LayoutMap):
    """A tf_keras LayoutMap whose layouts come from tfpod's rules engine.

    Use it through `tfpod.sharding(mesh, rules=...)` as a context manager: tf_keras
    models (functional, sequential or subclassed) built inside it have DVariables
    laid out by the rules. It records every variable it placed (`specs`, `layouts`,
    `report()`).

    Args:
      mesh: the mesh.
      rules: {path regex: axes} or [(path regex, axes)]; axes has one entry per
        dimension: a logical axis (see tfpod.sharding.LOGICAL_AXES, mapped to a mesh
        axis by the preset's table), a mesh axis, or None (not split). Paths are
        tf_keras object paths (`d1.kernel`; `block.attention.query.kernel` in a
        subclassed model); the regex must match the whole path.
      preset: the rules table giving logical axes their mesh axes (default `tensor`:
        heads, mlp and vocab over `model`).
      overrides: {logical axis: mesh axis or None} replacing entries of the table.
      cover_all: a variable no rule matches is an error (default: replicated).
    """

    def __init__(self, mesh: dtensor.Mesh, rules=None, preset: str = "tensor",
                 overrides: Mapping[str, str | None] | None = None, cover_all: bool = False):
        if not isinstance(mesh, dtensor.Mesh):
            raise UserError(
                f"tfpod.sharding: mesh is a {type(mesh).__name__}, not a dtensor.Mesh: make one with "
                "tfpod.make_mesh('data:-1,model:2')"
            )
        super().__init__(mesh=mesh)
        self.mesh = mesh
        self.rules = _parse_rules(rules, mesh)
        self.table = shardinglib.rules_table(preset, overrides)
        # Mesh axes named directly in a rule map to themselves.
        for r in self.rules:
            for a in r.axes:
                if a is not None and a not in shardinglib.LOGICAL_AXES:
                    self.table[a] = a
        self.cover_all = cover_all
        self.specs: dict[str, shardinglib.VarSpec] = {}
        self.layouts: dict[str, dtensor.Layout] = {}
        self.matched: dict[str, shardinglib.AxisRule | None] = {}
        self._scope = None

    # -- LayoutMap ------------------------------------------------------------

    def __getitem__(self, key):
        # Only placed variables have a layout (see _create_dvariable); anything else
        # tf_keras asks about (a random generator's state) is replicated.
        return self.layouts.get(key)

    def __setitem__(self, key, layout):
        raise UserError(
            f"tfpod.sharding takes its layouts from rules, not LayoutMap entries ({key!r}): pass "
            "rules={path regex: axes} to tfpod.sharding"
        )

    def place(self, path: str, variable) -> dtensor.Layout:
        """Validates one variable against the rules and records its layout (before allocation)."""
        spec = shardinglib.VarSpec(path, tuple(variable.shape.as_list()), variable.dtype)
        if any(d is None for d in spec.shape):
            raise UserError(
                f"variable {path} has an unknown dimension {spec.shape}: build the model with a "
                "fully defined shape (except the batch)"
            )
        hits = [r for r in self.rules if r.matches(path)]
        if hits or self.cover_all:
            layout = shardinglib.resolve([spec], hits, self.table, self.mesh)[path]
        else:
            layout = dtensor.Layout.replicated(self.mesh, len(spec.shape))
        self.specs[path] = spec
        self.layouts[path] = layout
        self.matched[path] = hits[0] if hits else None
        return layout

    # -- context --------------------------------------------------------------

    def __enter__(self):
        if self._scope is not None:
            raise UserError("tfpod.sharding(...) is already active: do not nest it (or re-enter it)")
        policy = tf_keras.mixed_precision.global_policy()
        if policy.compute_dtype != policy.variable_dtype:
            raise UserError(
                f"tfpod.sharding: the mixed-precision policy {policy.name!r} is not supported for Keras models (its "
                "AutoCastVariables are not placed on the mesh): set the policy to 'float32' while building"
            )
        _install()
        # DTensor initializers need tf.random.Generator-based Keras random ops.
        tf_keras.backend.experimental.enable_tf_random_generator()
        self._scope = _layout_map_lib().layout_map_scope(self)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc):
        scope, self._scope = self._scope, None
        return scope.__exit__(*exc)

    # -- reporting --------------------------------------------------------------

    def report(self, title: str = "keras variables") -> str:
        """The layout report (tfpod.sharding.layout_report) of every variable placed so far."""
        specs = list(self.specs.values())
        text = shardinglib.layout_report(specs, self.layouts, title=title)
        unmatched = [s.name for s in specs if self.matched[s.name] is None]
        if unmatched:
            names = ", ".join(unmatched[:6]) + (f", ... ({len(unmatched) - 6} more)" if len(unmatched) > 6 else "")
            text += f"# replicated (no rule): {len(unmatched)} of {len(specs)} variables: {names}\n"
        return text

    def check_rules_used(self) -> None:
        """Raises UserError for a rule that matched no variable placed under this map."""
        used = {r for r in self.matched.values() if r is not None}
        for r in self.rules:
            if r not in used:
                paths = list(self.specs)
                shown = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
                raise UserError(
                    f"sharding rule {r.pattern!r} {r.axes} matches no variable: fix its regex (it must match a "
                    f"whole variable path; this model's paths: {shown or 'none'}) or remove it"
                )


def sharding(mesh: dtensor.Mesh, rules=None, *, preset: str = "tensor",
             overrides: Mapping[str, str | None] | None = None, cover_all: bool = False) -> KerasSharding:
    """`with tfpod.sharding(mesh, rules=...):` build a tf_keras model with sharded DVariables.

    See KerasSharding for the arguments. The rules are checked now; each variable is
    checked as it is placed; `model.compile` then checks that every rule matched.

    Returns:
      The KerasSharding (a context manager; `report()` gives the layout report).
    """
    return KerasSharding(mesh, rules, preset=preset, overrides=overrides, cover_all=cover_all)


def layout_of(variable) -> dtensor.Layout:
    """The DTensor layout of a (sharded) model variable."""
    return dtensor.fetch_layout(getattr(variable, "_variable", variable))


# ---------------------------------------------------------------------------
# The tf_keras hooks (see the module docstring)


_ONE_STEP = weakref.WeakKeyDictionary()  # model -> {"predict_function"/"test_function": one-step function}


def _install() -> None:
    """Wraps tf_keras's DVariable creation and a few Model methods, once.

    Every wrapper acts only for a KerasSharding (a model built under
    `tfpod.sharding`) and calls the original otherwise. tf_keras asks a LayoutMap
    only for a layout by path; placing needs the variable's shape to validate first,
    hence the wrapper around `_create_dvariable`.
    """
    lib = _layout_map_lib()
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
            bound.arguments["optimizer"] = _prepare_compile(
                self, layout_map, bound.arguments.get("optimizer", "rmsprop"),
                bound.arguments.get("steps_per_execution"),
            )
            for key in ("metrics", "weighted_metrics"):
                if bound.arguments.get(key) is not None:
                    bound.arguments[key] = _mesh_metrics(bound.arguments[key], layout_map.mesh)
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

    call_fn, build_fn = training.Model.__call__, training.Model.build

    @functools.wraps(call_fn)
    def __call__(self, *args, **kwargs):
        layout_map = getattr(self, "_layout_map", None)
        if not self.built and isinstance(layout_map, KerasSharding):
            # tf_keras places a subclassed model's variables at its first call, then
            # runs the call with the user's inputs on the new DVariables: host tensors
            # must become (replicated) DTensors for that.
            args, kwargs = tf.nest.map_structure(lambda x: _on_mesh(x, layout_map.mesh, self.name), (args, kwargs))
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


def _one_step(method, attr: str):
    """Wraps Model.predict / evaluate: on a sharded model, one step per call (see _install)."""

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


def get_values(variables) -> list:
    """Host numpy copies of (sharded) DVariables or DTensors: each gathered to a replicated value first.

    DTensor cannot copy a sharded tensor to the host (`.numpy()` of a split weight
    fails), so the sharded model's `get_weights` goes through here; it works on
    every host of a multi-host job.
    """
    out = []
    for v in variables:
        inner = getattr(v, "_variable", v)
        value = inner.read_value() if isinstance(inner, tf.Variable) else tf.convert_to_tensor(inner)
        layout = dtensor.fetch_layout(value)
        if not layout.is_fully_replicated():
            value = dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank))
        out.append(dtensor.unpack(value)[0].numpy())
    return out


def set_values(variables, values) -> None:
    """Assigns host values to (sharded) DVariables, each relaid out to its variable's layout."""
    variables = list(variables)
    values = list(values)
    if len(values) != len(variables):
        raise UserError(f"set_weights: got {len(values)} values for {len(variables)} weights")
    for v, value in zip(variables, values):
        inner = getattr(v, "_variable", v)
        layout = dtensor.fetch_layout(inner)
        value = tf.convert_to_tensor(value, dtype=inner.dtype)
        if value.shape != inner.shape:
            raise UserError(f"set_weights: weight {inner.name} has shape {inner.shape}, got a value of shape {value.shape}")
        replicated = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(layout.mesh, value.shape.rank))
        inner.assign(dtensor.relayout(replicated, layout))


def _prepare_compile(model, layout_map: KerasSharding, optimizer, steps_per_execution):
    """Checks a sharded model before compile and returns its optimizer on the mesh."""
    if not model.built:
        raise UserError(
            f"model {model.name!r} has no variables yet: build it before compile (call it on a batch, "
            "or model.build(input_shape)); its variables are placed on the mesh when it is built"
        )
    off_mesh = [w.name for w in model.weights if not _is_dvariable(getattr(w, "_variable", w))]
    if off_mesh:
        raise UserError(
            f"weight {off_mesh[0]} of model {model.name!r} is not on the mesh (a mixed-precision variable, "
            "or one created outside the model's layers or outside tfpod.sharding): use a float32 policy and "
            "create every variable in the model's layers inside `with tfpod.sharding(...)`"
        )
    layout_map.check_rules_used()
    _unfuse_normalization(model)
    if steps_per_execution == "auto":
        raise UserError("steps_per_execution='auto' is not supported with tfpod.sharding: give a number")
    log.info("layouts:\n%s", layout_map.report(f"{model.name} variables"))
    return mesh_optimizer(optimizer, model, layout_map.mesh)


def _mesh_metrics(metrics, mesh: dtensor.Mesh):
    """Metric objects with their state as replicated DVariables on the mesh.

    Metrics given by name are created by Keras on the model's mesh; a metric object
    made by the user has ordinary (or, made inside `tfpod.sharding`, lazy) variables,
    which a DTensor train step silently updates wrongly, so it is re-created from its
    config with the mesh set before its variables are made (how tf_keras's own
    `mesh=` argument of metrics works).
    """
    from tf_keras.src.metrics import base_metric

    def place(m):
        if not isinstance(m, base_metric.Metric):
            return m
        if m.variables and all(_is_dvariable(v) for v in m.variables):
            return m
        new = type(m).__new__(type(m))
        object.__setattr__(new, "_mesh", mesh)
        try:
            new.__init__(**m.get_config())
        except (TypeError, ValueError, NotImplementedError) as e:
            raise UserError(
                f"metric {m.name!r} ({type(m).__name__}) cannot be re-created on the mesh from its config ({e}): "
                f"pass it by name, or create it with mesh=<the model's mesh>"
            ) from None
        return new

    if isinstance(metrics, dict):
        return {k: _mesh_metrics(v, mesh) for k, v in metrics.items()}
    if isinstance(metrics, (list, tuple)):
        return type(metrics)(_mesh_metrics(m, mesh) for m in metrics)
    return place(metrics)


def _unfuse_normalization(model) -> None:
    """Makes layer and batch normalization use their unfused ops.

    DTensor has no layout propagation for FusedBatchNormV3, which both layers use by
    default ("'tf.FusedBatchNormV3' op does not implement layout propagation" when
    the train step compiles); the unfused moments are reductions DTensor handles
    (over the whole batch when it is sharded: synchronized batch norm). Keras's
    BatchNormalization trains through `fused.batch_norm` (a hand-written gradient).
    """
    from tf_keras.src.layers.normalization import batch_normalization, layer_normalization

    fused.use_batch_norm(model)
    for layer in model._flatten_layers():
        if isinstance(layer, layer_normalization.LayerNormalization) and getattr(layer, "_fused", False):
            layer._fused = False
        elif isinstance(layer, batch_normalization.BatchNormalizationBase) and getattr(layer, "fused", False):
            layer.fused = False


def mesh_optimizer(optimizer, model, mesh: dtensor.Mesh):
    """The optimizer, on the mesh: tf_keras's DTensor optimizer, or a legacy one with DVariable state.

    Args:
      optimizer: a name ('adam'), a config dict, a tf_keras optimizer instance
        (re-created from its config with `mesh=` unless it already has it), or a
        legacy optimizer (tf_keras.optimizers.legacy, tf-models-official's) whose
        step counter, hyperparameters and slots are created now as DVariables.
      model: the built model (its trainable variables get the slots).
      mesh: the mesh.
    """
    from tf_keras.src.optimizers import optimizer as new_optimizer
    from tf_keras.src.optimizers.legacy import optimizer_v2

    if isinstance(optimizer, (str, dict)):
        optimizer = tf_keras.optimizers.get(optimizer)
    if isinstance(optimizer, new_optimizer.Optimizer):
        if getattr(optimizer, "_mesh", None) is not None:
            if optimizer._mesh != mesh:
                raise UserError(
                    f"optimizer {optimizer.name!r} was made for another mesh than the model's: make it with "
                    "the model's mesh, or pass it by name"
                )
            return optimizer
        if any(v is not optimizer.iterations for v in optimizer.variables):
            raise UserError(
                f"optimizer {optimizer.name!r} already has state (slots), so it cannot be moved onto the mesh: "
                "pass a fresh optimizer (or its name) to compile"
            )
        config = optimizer.get_config()
        config.pop("is_legacy_optimizer", None)
        return _from_config(optimizer, config, mesh)
    if isinstance(optimizer, optimizer_v2.OptimizerV2):
        from tfpod import optimizers as tfpod_optimizers

        if optimizer._slots or optimizer._hypers_created:
            inner = [v for v in optimizer.variables()]
            if inner and not all(_is_dvariable(v) for v in inner):
                raise UserError(
                    f"optimizer {optimizer.name!r} already has state outside the mesh: pass a fresh optimizer"
                )
        tfpod_optimizers.create_state(optimizer, model.trainable_variables, mesh)
        return optimizer
    raise UserError(
        f"optimizer {optimizer!r} is not a tf_keras optimizer: pass a name such as 'adam', a "
        "tf_keras.optimizers optimizer, or a legacy one (tf_keras.optimizers.legacy, tf-models-official)"
    )


def _from_config(optimizer, config: dict, mesh: dtensor.Mesh):
    from tf_keras.src.optimizers.schedules import learning_rate_schedule

    if isinstance(config.get("learning_rate"), dict):
        config["learning_rate"] = learning_rate_schedule.deserialize(config["learning_rate"])
    try:
        return type(optimizer)(**config, mesh=mesh)
    except TypeError as e:
        raise UserError(
            f"optimizer {type(optimizer).__name__} cannot be re-created on the mesh ({e}): create it with "
            f"mesh=<the model's mesh> yourself"
        ) from None


def _is_dvariable(v) -> bool:
    try:
        dtensor.fetch_layout(v)
        return True
    except Exception:  # noqa: BLE001 - fetch_layout raises several types for non-DTensors
        return False


# ---------------------------------------------------------------------------
# Input: a dataset of global batches -> batch-sharded DTensors


def _dataset_ops():
    from tensorflow.python.data.ops import dataset_ops

    return dataset_ops


def _dtensor_iterator_class():
    from tensorflow.dtensor.python import input_util

    class _MeshIterator(input_util._DTensorIterator):
        """A DTensor iterator that stops after the dataset's known number of batches.

        Reading past the end of a DTensor iterator eagerly leaves the DTensor runtime
        broken for the rest of the process (later ops fail with "Function was
        cancelled before it was started"), so Python iteration stops on the count
        instead of on end-of-sequence. (Keras reads exactly `cardinality` batches
        inside its compiled functions, where the iterator is the plain one.)
        """

        def __init__(self, remaining: int | None, **kwargs):
            super().__init__(**kwargs)
            self._remaining = remaining

        def __next__(self):
            if self._remaining is not None:
                if self._remaining <= 0:
                    raise StopIteration
                self._remaining -= 1
            return super().__next__()

    return _MeshIterator


class MeshDataset(_dataset_ops().UnaryUnchangedStructureDataset):
    """A dataset whose iterator yields batch-sharded DTensors over a mesh (see `to_mesh`).

    To Keras it is an ordinary dataset (not a "distributed" one): fit makes a new
    iterator every epoch and takes the number of steps from `cardinality()`, which
    is always known (or infinite).
    """

    def __init__(self, host_batches: tf.data.Dataset, mesh: dtensor.Mesh, layouts, global_spec,
                 device_datasets: list):
        super().__init__(host_batches, host_batches._variant_tensor)
        self._mesh = mesh
        self._layouts = layouts
        self._global_spec = global_spec
        self._device_datasets = device_datasets  # one per local device, in mesh order
        count = int(host_batches.cardinality().numpy())
        self._count = None if count == tf.data.INFINITE_CARDINALITY else count

    @property
    def element_spec(self):
        return self._global_spec

    @property
    def mesh(self) -> dtensor.Mesh:
        return self._mesh

    def map(self, *args, **kwargs):
        # Mapping would iterate the host batches, not the DTensors: Keras maps the
        # dataset for fit(class_weight=...), for example.
        raise UserError(
            "a to_mesh dataset cannot be transformed (map, or fit(class_weight=...)): transform the dataset "
            "before to_mesh, and give per-example weights as the third element (x, y, sample_weight)"
        )

    def __iter__(self):
        from tensorflow.dtensor.python import api

        host_mesh = self._mesh.host_mesh()
        resources = []
        for device, dataset in zip(host_mesh.local_devices(), self._device_datasets):
            with tf.device(device):
                resources.append(iter(dataset)._iterator_resource)
        # The per-device iterators, packed as one DTensor resource (as DTensorDataset does).
        packed = api.pack(resources, dtensor.Layout.replicated(host_mesh, rank=0))
        host_layouts = tf.nest.map_structure(lambda l: dtensor.Layout(l.sharding_specs, host_mesh), self._layouts)
        api._dtensor_device().set_iterator_element_layouts(packed, tf.nest.flatten(host_layouts))
        return _dtensor_iterator_class()(
            self._count, dtensor_components=(packed,), global_element_spec=self._global_spec, layouts=self._layouts
        )


def _batch_size_of(specs) -> int | None:
    sizes = {s.shape[0] for s in specs if s.shape[0] is not None}
    if len(sizes) > 1:
        raise UserError(f"to_mesh: the dataset's features have different batch sizes {sorted(sizes)}")
    return sizes.pop() if sizes else None


def _element(e):
    """A dataset function's arguments as the element (tuples arrive unpacked)."""
    return e if len(e) > 1 else e[0]


def to_mesh(dataset: tf.data.Dataset, mesh: dtensor.Mesh, batch_axis: str | None = "data", *,
            global_batch_size: int | None = None, num_batches: int | None = None, per_host: bool = False,
            prefetch: int = 2) -> MeshDataset:
    """A tf.data.Dataset of global batches -> a dataset of batch-sharded DTensors for Keras.

    Every element is `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)` (each a tensor
    or a nest of tensors) whose first dimension is the batch. Each batch is split
    over the mesh axis `batch_axis` into equal blocks of consecutive rows in shard
    order; devices along the other mesh axes get the same rows. Every local device
    reads its rows through its own iterator over the dataset, so the dataset's work
    runs once per local device (as with dtensor.DTensorDataset): keep per-batch work
    light, or cache.

    Several hosts: with `per_host=False` every host iterates the same global batches
    (the same files, order and seed on every host) and keeps the rows of its own
    devices; with `per_host=True` each host's dataset holds only its own rows (the
    rows of the batch shards its devices hold, in shard order, global_batch / hosts
    when hosts own whole shards), so no host reads the others' data.

    A partial batch (the last one of a dataset batched without drop_remainder)
    cannot be split into equal static shards: it is dropped. The number of batches
    must be known so that Keras stops before the end of the data (a DTensor iterator
    read past its end breaks the DTensor runtime): when TensorFlow cannot infer it
    (after filter, or with a partial batch dropped) it is counted here with one pass
    over the dataset, unless `num_batches` gives it. A repeated (infinite) dataset
    needs `steps_per_epoch` in fit, as usual.

    Args:
      dataset: batches of global_batch_size rows (this host's rows with per_host=True).
      mesh: the mesh.
      batch_axis: mesh axis the batch is split over; None replicates every batch.
      global_batch_size: rows of a global batch; default: the dataset's static
        batch dimension (or its first batch's, read once).
      num_batches: the number of full batches, when TensorFlow cannot infer it
        (default: counted).
      per_host: see above.
      prefetch: batches each device's iterator prefetches.

    Returns:
      A MeshDataset for model.fit / evaluate / predict (and validation_data).

    Raises:
      UserError: the batch does not divide over the batch axis, an unknown axis,
        an empty dataset, or elements that are not dense tensors with a batch
        dimension.
    """
    from tfpod.input import feed

    if not isinstance(dataset, tf.data.Dataset):
        raise UserError(f"to_mesh: expected a tf.data.Dataset of batches, got {type(dataset).__name__}")
    if isinstance(dataset, MeshDataset):
        raise UserError("to_mesh: the dataset is already on a mesh (to_mesh was applied twice)")
    if batch_axis is not None and batch_axis not in mesh.dim_names:
        raise UserError(
            f"to_mesh: batch_axis={batch_axis!r} is not an axis of the mesh ({', '.join(mesh.dim_names)}): "
            "name one of them, or None to replicate the batches"
        )
    flat_specs = tf.nest.flatten(dataset.element_spec)
    for s in flat_specs:
        if not isinstance(s, tf.TensorSpec):
            raise UserError(
                f"to_mesh: dataset elements must be dense tensors, got a {type(s).__name__}: convert ragged or "
                "sparse features to padded dense tensors first"
            )
        if s.shape.rank is None or s.shape.rank < 1:
            raise UserError(f"to_mesh: every feature needs a batch dimension, got one of shape {s.shape}")
    shards = mesh.dim_size(batch_axis) if batch_axis else 1
    local = feed.local_shards(mesh, batch_axis)
    static = _batch_size_of(flat_specs)
    if global_batch_size is None:
        if per_host:
            raise UserError("to_mesh(per_host=True) needs global_batch_size (the rows of all hosts' batches together)")
        global_batch_size = static
        if global_batch_size is None:
            first = next(iter(dataset.take(1)), None)
            if first is None:
                raise UserError("to_mesh: the dataset is empty")
            global_batch_size = int(tf.nest.flatten(first)[0].shape[0])
    rows = feed.host_rows(global_batch_size, mesh, batch_axis)
    per_shard = global_batch_size // shards
    expected = rows if per_host else global_batch_size
    if static is not None and static != expected:
        raise UserError(
            f"to_mesh: the dataset's batches have {static} rows but "
            f"{'this host needs' if per_host else 'the global batch has'} {expected}: batch it with {expected}"
        )
    host_batches = dataset
    if static is None:
        # Only full batches have the static shape a DTensor needs; a partial last batch is dropped.
        host_batches = host_batches.filter(lambda *e: tf.equal(tf.shape(tf.nest.flatten(e)[0])[0], expected))
        host_batches = host_batches.map(lambda *e: tf.nest.map_structure(
            lambda t: tf.ensure_shape(t, [expected] + t.shape.as_list()[1:]), _element(e)))
    if int(host_batches.cardinality().numpy()) == tf.data.UNKNOWN_CARDINALITY:
        if num_batches is None:
            num_batches = int(host_batches.reduce(np.int64(0), lambda n, _: n + 1).numpy())
            log.info("to_mesh: counted %d full batches of %d rows (one pass over the dataset; pass "
                     "num_batches= to skip it)", num_batches, expected)
        host_batches = host_batches.apply(tf.data.experimental.assert_cardinality(num_batches))
    if int(host_batches.cardinality().numpy()) == 0:
        raise UserError(f"to_mesh: the dataset has no full batch of {expected} rows")
    elem_spec = host_batches.element_spec
    layouts = tf.nest.map_structure(
        lambda s: dtensor.Layout([batch_axis or dtensor.UNSHARDED] + [dtensor.UNSHARDED] * (s.shape.rank - 1), mesh),
        elem_spec,
    )
    global_spec = tf.nest.map_structure(
        lambda s: tf.TensorSpec([global_batch_size] + s.shape.as_list()[1:], s.dtype, s.name), elem_spec
    )

    def rows_from(begin):
        return lambda *e: tf.nest.map_structure(lambda t: t[begin:begin + per_shard], _element(e))

    device_datasets = []
    for loc in mesh.local_device_locations():
        ds = host_batches
        if batch_axis is not None:
            shard = loc[batch_axis]
            ds = ds.map(rows_from((local.index(shard) if per_host else shard) * per_shard))
        device_datasets.append(ds.prefetch(prefetch) if prefetch else ds)
    return MeshDataset(host_batches, mesh, layouts, global_spec, device_datasets)


# ---------------------------------------------------------------------------
# Checkpoints in tfpod's format


class _Resume:
    """What Model.fit asks `model._training_state` for: the (epoch, step) to start at."""

    def __init__(self, step: int):
        self.step = step

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        del mode
        if not steps_per_epoch:
            log.warning("resumed at step %d but the epoch length is unknown: fit starts at epoch %d",
                        self.step, initial_epoch)
            return initial_epoch, 0
        epoch, step = divmod(self.step, int(steps_per_epoch))
        if epoch < initial_epoch:
            return initial_epoch, 0
        return epoch, step


class Checkpoint(tf_keras.callbacks.Callback):
    """Saves the sharded model and optimizer in tfpod's checkpoint layout; resumes fit from them.

    Writes `model_dir/checkpoints/ckpt-<step>` (step = the optimizer's step counter)
    through tfpod.checkpoint.CheckpointManager: the newest `keep` are kept, and a
    checkpoint with missing files (a save cut short) is never resumed from. At the
    start of fit the newest complete checkpoint is restored and fit continues at its
    step: epoch = step // steps_per_epoch, and the rest of that epoch (its batches
    start again from the beginning of the data, as with Keras's BackupAndRestore,
    unless the checkpoint was at an epoch end). `main.py --mode=eval` and other
    tfpod tools read the same layout.

    Args:
      model_dir: output folder.
      every_n_epochs: save at the end of every n-th epoch (0: not by epochs).
      every_n_steps: also save every n optimizer steps (None: not by steps).
      keep: how many checkpoints to keep.
      restore: restore the newest checkpoint at the start of fit.
    """

    def __init__(self, model_dir: str, every_n_epochs: int = 1, every_n_steps: int | None = None, keep: int = 3,
                 restore: bool = True):
        super().__init__()
        if every_n_epochs < 0 or (every_n_steps is not None and every_n_steps < 1):
            raise UserError(
                f"tfpod.keras.Checkpoint: every_n_epochs={every_n_epochs} must be >= 0 and every_n_steps="
                f"{every_n_steps} >= 1 (or None)"
            )
        if keep < 1:
            raise UserError(f"tfpod.keras.Checkpoint: keep={keep} must be at least 1")
        self.model_dir, self.every_n_epochs, self.every_n_steps = model_dir, every_n_epochs, every_n_steps
        self.keep, self.restore = keep, restore
        self.manager: checkpointlib.CheckpointManager | None = None
        self.restored_step: int | None = None
        self._saved_step = -1
        self._previous_state = None

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def on_train_begin(self, logs=None):
        model = self.model
        optimizer = model.optimizer
        if optimizer is None:
            raise UserError("tfpod.keras.Checkpoint: compile the model before fit")
        _build_optimizer_state(optimizer, model)
        if self.manager is None:
            self.manager = checkpointlib.CheckpointManager(
                self.model_dir, optimizer.iterations, keep=self.keep, model=model, optimizer=optimizer
            )
        self.restored_step = self.manager.restore_latest() if self.restore else None
        self._saved_step = self.restored_step if self.restored_step is not None else -1
        self._previous_state = model._training_state
        if self.restored_step:
            model._training_state = _Resume(self.restored_step)

    def _save(self):
        step = self._step()
        if step != self._saved_step:
            self.manager.save()
            self._saved_step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_steps:
            step = self._step()
            if step // self.every_n_steps > max(self._saved_step, 0) // self.every_n_steps:
                self._save()

    def on_epoch_end(self, epoch, logs=None):
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self._save()

    def on_train_end(self, logs=None):
        self._save()
        self.model._training_state = self._previous_state


def _build_optimizer_state(optimizer, model) -> None:
    """Creates the optimizer's slots now, so a checkpoint restores into them (not lazily later)."""
    from tf_keras.src.optimizers import optimizer as new_optimizer

    if isinstance(optimizer, new_optimizer.Optimizer) and not getattr(optimizer, "_built", False):
        with tf.init_scope():
            optimizer.build(model.trainable_variables)
