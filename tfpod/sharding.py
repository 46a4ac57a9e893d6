"""Partitioning, owned in one place: logical axes, rules tables as data, validation, layouts.

Models name the dimensions of their variables with *logical axes* (`batch`, `length`,
`embed`, `heads`, `kv`, `mlp`, `vocab`, `expert`). Variable-path rules (regex over the
variable name, e.g. `gpt/block_\\d+/self_attention/query/kernel`) give logical axes to
variables of layers we do not write (tf-models-official). One *rules table* maps each
logical axis to a mesh axis (or to nothing: replicated). Presets are rules tables:

    data           every weight replicated, the batch split over `data`
    tensor         Megatron-LM: heads and mlp hidden over `model` (column-parallel into
                   a block, row-parallel out of it), vocab-parallel embedding and
                   output layer; MoE experts over `expert`
    2d             `tensor`, and every weight's `embed` dimension also over `data`
                   (weights and optimizer state divided by the whole mesh; DTensor
                   gathers a weight's `data` shards where a layer uses it)
    weight_update  `tensor` for compute, and the optimizer state and update sharded
                   over `data` (MLPerf TPU-pod weight-update sharding, ZeRO-style): see
                   UPDATE_AXIS and tfpod.optimizers.Update

Two switches combine with any preset: `sequence_parallel` maps the residual stream's
`sequence` axis to `model` (Megatron sequence parallelism: layer norms and dropout
between blocks run on sequence shards), and `update_axis` names a mesh axis over which
the optimizer state and update are sharded.

A rules table names mesh axes, not sizes: on a mesh without a `model` axis the
`tensor` preset's model-parallel dimensions are simply replicated, so one table serves
every mesh. Within one tensor a mesh axis shards at most one dimension (the first).

Everything is validated before a variable is allocated: a rank mismatch, a dimension
not divisible by its mesh axis, a variable matched by two rules, a variable matched by
none, and a rule that matches nothing each raise one UserError naming the variable, its
shape and the rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading
from typing import Iterable, Mapping, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError

LOGICAL_AXES = ("batch", "length", "sequence", "embed", "heads", "kv", "mlp", "vocab", "expert")

AxisNames = tuple  # tuple[str | None, ...]: one logical axis (or None) per dimension

_MEGATRON = {"heads": "model", "mlp": "model", "vocab": "model", "expert": "expert"}
PRESETS: dict[str, dict[str, str | None]] = {
    "data": {"batch": "data"},
    "tensor": {"batch": "data", **_MEGATRON},
    "2d": {"batch": "data", **_MEGATRON, "embed": "data"},
    "weight_update": {"batch": "data", **_MEGATRON},
}
# The mesh axis a preset shards the optimizer state and update over (default: none,
# the state is laid out like its weight).
UPDATE_AXIS: dict[str, str] = {"weight_update": "data"}
# The mesh axis whose weight shards a preset gathers where a layer uses the weight
# (default: none, weights are used in their stored layout).
GATHER_AXIS: dict[str, str] = {"2d": "data"}


@dataclasses.dataclass(frozen=True)
class AxisRule:
    """Variables whose name matches `pattern` (re.fullmatch) have these logical axes."""

    pattern: str
    axes: AxisNames

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise UserError(f"sharding rule {self.pattern!r}: not a valid regex ({e})") from None
        for a in self.axes:
            if a is not None and a not in LOGICAL_AXES:
                raise UserError(
                    f"sharding rule {self.pattern!r}: unknown logical axis {a!r}; "
                    f"use one of {', '.join(LOGICAL_AXES)} or None"
                )

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


@dataclasses.dataclass(frozen=True)
class VarSpec:
    """A variable before allocation: its name (no ':0'), global shape and dtype."""

    name: str
    shape: tuple
    dtype: tf.DType = tf.float32


def rules_table(preset: str, overrides: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """The logical->mesh axis table of a preset, with user overrides applied.

    Args:
      preset: a key of PRESETS.
      overrides: {logical_axis: mesh_axis or None} replacing the preset's entries.

    Raises:
      UserError: unknown preset or unknown logical axis.
    """
    if preset not in PRESETS:
        raise UserError(
            f"sharding.preset={preset!r} is not a preset: use one of {', '.join(sorted(PRESETS))}"
        )
    table = {a: None for a in LOGICAL_AXES}
    table.update(PRESETS[preset])
    for logical, mesh_axis in (overrides or {}).items():
        if logical not in LOGICAL_AXES:
            raise UserError(
                f"sharding.rules: unknown logical axis {logical!r}; use one of {', '.join(LOGICAL_AXES)}"
            )
        table[logical] = mesh_axis
    return table


def check_mesh_axes(mesh: dtensor.Mesh, table: Mapping[str, str | None], also_used: Iterable[str | None] = (),
                    preset: str = "", fix: str = "") -> None:
    """Raises one UserError for a mesh axis of more than one device that nothing maps to.

    The devices along such an axis would each repeat the same work on the same data
    with the same replicated weights (a typo like `modle:2` did that silently).

    Args:
      mesh: the mesh.
      table: logical axis -> mesh axis.
      also_used: other mesh axes in use (the update axis, the gather axis).
      preset: the preset's name, for the message.
      fix: how a rule maps something to the axis, for the message.
    """
    used = {a for a in table.values() if a} | {a for a in also_used if a}
    for axis in mesh.dim_names:
        if mesh.dim_size(axis) > 1 and axis not in used:
            names = ", ".join(repr(a) for a in sorted(used)) or "none"
            rules = f"preset {preset!r}" if preset else "the sharding rules"
            raise UserError(
                f"mesh axis {axis!r} (size {mesh.dim_size(axis)}) is used by no rule of {rules} (its mesh axes: "
                f"{names}): the devices along it would only repeat each other's work; rename the axis to one of "
                f"those, or {fix or 'map a logical axis to it'}"
            )


def layout_for(axes: Sequence[str | None], table: Mapping[str, str | None], mesh: dtensor.Mesh) -> dtensor.Layout:
    """The DTensor layout of a tensor whose dimensions have these logical axes.

    A logical axis mapped to a mesh axis the mesh lacks is replicated; a mesh axis
    already used by an earlier dimension of the same tensor is not used again.
    """
    used = set()
    specs = []
    for a in axes:
        mesh_axis = table.get(a) if a is not None else None
        if mesh_axis is not None and mesh_axis in mesh.dim_names and mesh_axis not in used:
            used.add(mesh_axis)
            specs.append(mesh_axis)
        else:
            specs.append(dtensor.UNSHARDED)
    return dtensor.Layout(specs, mesh)


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def resolve(
    specs: Iterable[VarSpec],
    axis_rules: Sequence[AxisRule],
    table: Mapping[str, str | None],
    mesh: dtensor.Mesh,
) -> dict[str, dtensor.Layout]:
    """Validates every variable against the rules and returns its layout.

    Args:
      specs: the model's variables (name, global shape).
      axis_rules: variable-path rules giving logical axes.
      table: logical axis -> mesh axis (see rules_table).
      mesh: the mesh the layouts live on.

    Returns:
      {variable name: Layout}.

    Raises:
      UserError: two variables with one name, a variable matched by two rules or by
        none, a rule that matches nothing, a rank mismatch, or a dimension not divisible
        by the size of its mesh axis.
    """
    specs = list(specs)
    seen = set()
    for s in specs:
        if s.name in seen:
            raise UserError(
                f"two variables are named {s.name!r}: give the layers distinct names so rules can tell them apart"
            )
        seen.add(s.name)
    used_rules = set()
    layouts = {}
    for s in specs:
        hits = [r for r in axis_rules if r.matches(s.name)]
        if len(hits) > 1:
            raise UserError(
                f"variable {s.name} {_shape_text(s.shape)} is matched by two sharding rules, "
                f"{hits[0].pattern!r} and {hits[1].pattern!r}: narrow one so each variable has one rule"
            )
        if not hits:
            raise UserError(
                f"variable {s.name} {_shape_text(s.shape)} matches no sharding rule: add a rule "
                f"(regex, logical axes) for it, e.g. ({re.escape(s.name)!r}, {(None,) * len(s.shape)!r})"
            )
        rule = hits[0]
        used_rules.add(rule)
        if len(rule.axes) != len(s.shape):
            raise UserError(
                f"variable {s.name} {_shape_text(s.shape)} has rank {len(s.shape)} but rule "
                f"{rule.pattern!r} gives {len(rule.axes)} logical axes {rule.axes}: give one axis per dimension"
            )
        layout = layout_for(rule.axes, table, mesh)
        for dim, (size, mesh_axis) in enumerate(zip(s.shape, layout.sharding_specs)):
            if mesh_axis != dtensor.UNSHARDED and size % mesh.dim_size(mesh_axis):
                raise UserError(
                    f"variable {s.name} {_shape_text(s.shape)}: dimension {dim} ({rule.axes[dim]}, size {size}) "
                    f"does not divide over mesh axis {mesh_axis!r} of size {mesh.dim_size(mesh_axis)} "
                    f"(rule {rule.pattern!r}): change the model size, the mesh, or map "
                    f"{rule.axes[dim]!r} to no mesh axis in sharding.rules"
                )
        layouts[s.name] = layout
    unused = [r for r in axis_rules if r not in used_rules]
    if unused:
        raise UserError(
            f"sharding rule {unused[0].pattern!r} {unused[0].axes} matches no variable: fix its "
            "regex (it must match a whole variable name, see layouts.txt) or remove it"
        )
    return layouts


# ---------------------------------------------------------------------------
# Layout report


def bytes_per_device(shape: Sequence[int], dtype: tf.DType, layout: dtensor.Layout) -> int:
    """Bytes one device holds of a tensor with this global shape and layout."""
    local = [
        d if spec == dtensor.UNSHARDED else d // layout.mesh.dim_size(spec)
        for d, spec in zip(shape, layout.sharding_specs)
    ]
    return math.prod(local) * tf.as_dtype(dtype).size


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def layout_report(
    specs: Iterable[VarSpec],
    layouts: Mapping[str, dtensor.Layout],
    title: str = "variables",
) -> str:
    """A table: variable, global shape, layout, bytes per device; then totals."""
    specs = list(specs)
    rows = []
    total_params = total_bytes = device_bytes = 0
    for s in specs:
        layout = layouts[s.name]
        per_dev = bytes_per_device(s.shape, s.dtype, layout)
        n = math.prod(s.shape)
        total_params += n
        total_bytes += n * s.dtype.size
        device_bytes += per_dev
        rows.append((s.name, _shape_text(s.shape), "[" + ", ".join(layout.sharding_specs) + "]", _human(per_dev)))
    header = ("variable", "global shape", "layout", "bytes/device")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    mesh = next(iter(layouts.values())).mesh if layouts else None
    lines = [
        f"# {title}"
        + (f" on mesh {','.join(f'{n}:{mesh.dim_size(n)}' for n in mesh.dim_names)}" if mesh else ""),
        "  ".join(h.ljust(w) for h, w in zip(header, widths)),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(
        f"# total: {len(specs)} variables, {total_params:,} parameters, {_human(total_bytes)}; "
        f"per device: {_human(device_bytes)}"
    )
    for axis in (mesh.dim_names if mesh else []):
        split = [s for s in specs if axis in layouts[s.name].sharding_specs]
        if split:
            names = ", ".join(s.name for s in split[:6]) + (f", ... ({len(split) - 6} more)" if len(split) > 6 else "")
            lines.append(f"# split over {axis!r}: {len(split)} of {len(specs)} variables: {names}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Activation annotations (GShard's split / replicate, inside the compiled step)

_ACTIVE = threading.local()


@contextlib.contextmanager
def activation_sharding(mesh: dtensor.Mesh, table: Mapping[str, str | None]):
    """Within this context `shard`/`split`/`replicate` relayout activations on `mesh`.

    Outside it (single-device export, plain Keras) they return their input unchanged.
    """
    prev = getattr(_ACTIVE, "value", None)
    _ACTIVE.value = (mesh, dict(table))
    try:
        yield
    finally:
        _ACTIVE.value = prev


def active_context():
    """(mesh, table) of the enclosing `activation_sharding` context, or None outside one."""
    return getattr(_ACTIVE, "value", None)


def shard(x: tf.Tensor, axes: Sequence[str | None]) -> tf.Tensor:
    """Annotates an activation with logical axes, one per dimension (GShard `shard`)."""
    active = active_context()
    if active is None:
        return x
    mesh, table = active
    if len(axes) != x.shape.rank:
        raise ValueError(f"shard: tensor of shape {x.shape} got {len(axes)} logical axes {tuple(axes)}")
    return dtensor.relayout(x, layout_for(axes, table, mesh))


def split(x: tf.Tensor, dim: int, mesh_axis: str) -> tf.Tensor:
    """Splits one dimension of an activation over a mesh axis, others replicated (GShard `split`)."""
    active = active_context()
    if active is None:
        return x
    mesh, _ = active
    specs = [dtensor.UNSHARDED] * x.shape.rank
    if mesh_axis in mesh.dim_names:
        specs[dim] = mesh_axis
    return dtensor.relayout(x, dtensor.Layout(specs, mesh))


def replicate(x: tf.Tensor) -> tf.Tensor:
    """Replicates an activation on every device (GShard `replicate`)."""
    active = active_context()
    if active is None:
        return x
    mesh, _ = active
    return dtensor.relayout(x, dtensor.Layout.replicated(mesh, x.shape.rank))


def random_layout(shape: Sequence[int | None], mesh: dtensor.Mesh) -> dtensor.Layout:
    """The one layout every random draw of a step on `mesh` is generated in.

    DTensor gives each device of a sharded random op its own seed, computed from the
    device's coordinates on the mesh axes the op's layout shards. It reuses that seed
    computation between random ops of one function when their sharded axes match, but
    the match compares only a prefix: an op sharded over `data` alone then takes the
    seed of one sharded over `data` and `model`, and the devices of one `data` shard
    draw different values for a tensor that is replicated over `model`. Under the
    `tensor` preset that made the replicas of replicated weights drift apart as soon
    as two dropouts with differently sharded inputs (embeddings and attention
    probabilities) were on.

    So every draw is made sharded over all axes of more than one device (the first
    axis on the first dimension it divides, and so on), and relaid out to whatever
    its consumer needs; a shape that cannot hold all of them is drawn replicated (each
    device draws it whole, with the same seed). Either way the same seeds give the
    same values on every device that holds the same element.
    """
    axes = [a for a in mesh.dim_names if mesh.dim_size(a) > 1]
    specs = [dtensor.UNSHARDED] * len(shape)
    for axis in axes:
        free = [i for i, d in enumerate(shape) if specs[i] == dtensor.UNSHARDED and d and d % mesh.dim_size(axis) == 0]
        if not free:
            return dtensor.Layout.replicated(mesh, len(shape))
        specs[free[0]] = axis
    return dtensor.Layout(specs, mesh)


# ---------------------------------------------------------------------------
# Materializing a Keras model as sharded DVariables


def _lazy_variables(model):
    """[(object_path, variable)] of a lazily built tf_keras model, one entry per path.

    `variable` is a LazyInitVariable, or (under a mixed-precision policy) an
    AutoCastVariable wrapping one.
    """
    from tf_keras.src.dtensor import lazy_variable

    def is_lazy(o):
        inner = getattr(o, "_variable", o) if type(o).__name__ == "AutoCastVariable" else o
        return isinstance(inner, lazy_variable.LazyInitVariable)

    return [(".".join(str(p) for p in path), v) for path, v in model._flatten(predicate=is_lazy, with_path=True)]


def _unwrap(v):
    return v._variable if type(v).__name__ == "AutoCastVariable" else v


def _var_name(v) -> str:
    return v.name[:-2] if v.name.endswith(":0") else v.name


def _lazy_build(model_fn, input_signature):
    """Builds the model symbolically with lazily initialized variables (nothing allocated)."""
    import tf_keras
    from tf_keras.src.dtensor import lazy_variable

    tf_keras.backend.experimental.enable_tf_random_generator()  # DTensor needs tf.random.Generator
    with lazy_variable.lazy_init_scope():
        model = model_fn()
        inputs = tf.nest.map_structure(
            lambda s: tf_keras.Input(shape=s.shape[1:], dtype=s.dtype, name=getattr(s, "name", None)),
            input_signature,
        )
        model(inputs)
    pairs = _lazy_variables(model)
    by_id = {}
    for path, v in pairs:
        by_id.setdefault(id(v), (path, v))
    specs = [VarSpec(_var_name(v), tuple(v.shape.as_list()), _unwrap(v).dtype) for _, v in by_id.values()]
    return model, pairs, by_id, specs


def variable_specs(model_fn, input_signature) -> list[VarSpec]:
    """The model's variables (name, global shape, dtype) without allocating any."""
    return _lazy_build(model_fn, input_signature)[3]


def build_sharded(
    model_fn,
    input_signature,
    mesh: dtensor.Mesh,
    axis_rules: Sequence[AxisRule],
    table: Mapping[str, str | None],
):
    """Builds a tf_keras model whose variables are DVariables laid out by the rules.

    The model is first built symbolically with lazily initialized variables (nothing is
    allocated), every variable is validated against the rules, and only then are the
    DVariables created with their layouts. Initial values are computed replicated and
    then relaid out, so they are the same on every mesh for the same seed.

    Args:
      model_fn: () -> tf_keras.Model (a subclassed model).
      input_signature: nest of tf.TensorSpec (batch dimension None) to build it with.
      mesh: the mesh.
      axis_rules: variable-path rules giving logical axes.
      table: logical axis -> mesh axis.

    Returns:
      (model, specs, layouts): the built model, its VarSpecs and {name: Layout}.

    Raises:
      UserError: any rules-validation error (see `resolve`), before allocation.
    """
    from tf_keras.src.dtensor import layout_map as layout_map_lib

    model, pairs, by_id, specs = _lazy_build(model_fn, input_signature)
    layouts = resolve(specs, axis_rules, table, mesh)
    path_layouts = {path: layouts[_var_name(v)] for path, v in pairs}

    class _Exact(layout_map_lib.LayoutMap):
        def __getitem__(self, key):
            return path_layouts.get(key)

    exact = _Exact(mesh=mesh)
    # Mixed precision: every reference shares the AutoCastVariable, so swapping the
    # variable inside it places them all; tf_keras maps the plain lazy variables.
    for path, v in by_id.values():
        if v is not _unwrap(v):
            v._variable = layout_map_lib._create_dvariable(exact, path, v._variable)
    layout_map_lib._map_subclass_model_variable(model, exact)
    model._layout_map = exact  # Keras-created counters become replicated DVariables
    return model, specs, layouts


def rows_split(variable) -> bool:
    """Whether a (D)Variable's first dimension is split over a mesh axis (False without a mesh)."""
    layout = getattr(_unwrap(variable), "layout", None)  # AutoCastVariable wraps it
    return layout is not None and layout.sharding_specs[0] != dtensor.UNSHARDED


def update_layout(layout: dtensor.Layout, shape: Sequence[int], axis: str | None) -> dtensor.Layout:
    """The layout of a weight's optimizer state when the update is sharded over `axis`.

    The first dimension that is unsharded and divisible by the axis size is split over
    it; a weight already sharded over `axis`, with no such dimension, or on a mesh
    without the axis keeps its own layout.
    """
    mesh = layout.mesh
    specs = list(layout.sharding_specs)
    if axis is None or axis not in mesh.dim_names or axis in specs:
        return layout
    n = mesh.dim_size(axis)
    for dim, (size, spec) in enumerate(zip(shape, specs)):
        if spec == dtensor.UNSHARDED and size % n == 0:
            specs[dim] = axis
            return dtensor.Layout(specs, mesh)
    return layout


_GATHERING = threading.local()


@contextlib.contextmanager
def gathered_weights():
    """Within this context, weights installed by `gather_when_used` read gathered."""
    prev = getattr(_GATHERING, "on", False)
    _GATHERING.on = True
    try:
        yield
    finally:
        _GATHERING.on = prev


def compute_layout(layout: dtensor.Layout, axis: str) -> dtensor.Layout:
    """`layout` with the dimension sharded over `axis` (if any) unsharded."""
    return dtensor.Layout([dtensor.UNSHARDED if s == axis else s for s in layout.sharding_specs], layout.mesh)


def gather_when_used(variables, axis: str | None) -> list[str]:
    """Makes weights stored sharded over `axis` read gathered over it inside `gathered_weights`.

    This is the `2d` preset's "gathered per layer when used" (FSDP / ZeRO-3): the
    weight stays sharded in memory and in the optimizer; where a layer reads it in the
    forward pass, the read is relaid out to the weight's layout without `axis` (an
    all-gather), and its gradient flows back through the relayout (reduce-scattered
    to the stored layout). Reads outside the context (the optimizer, checkpoints) see
    the stored shards.

    Returns:
      The names of the variables that gather.
    """
    names = []
    if axis is None:
        return names
    for v in variables:
        inner = _unwrap(v)
        layout = dtensor.fetch_layout(inner)
        if axis not in layout.sharding_specs:
            continue
        target = compute_layout(layout, axis)
        read = inner._read_variable_op

        def gathered_read(*args, _read=read, _target=target, **kwargs):
            value = _read(*args, **kwargs)
            return dtensor.relayout(value, _target) if getattr(_GATHERING, "on", False) else value

        inner._read_variable_op = gathered_read
        names.append(_var_name(inner))
    return names


@dataclasses.dataclass
class ShardingConfig:
    """Attributes map 1:1 to gin `sharding.<name>`.

    Attributes:
      preset: a key of PRESETS (None: the experiment's default).
      rules: {logical axis: mesh axis or None} overriding the preset's table.
      sequence_parallel: split the residual stream between blocks over `model` along
        the sequence (Megatron sequence parallelism).
      update_axis: mesh axis to shard the optimizer state and update over (None: the
        preset's, see UPDATE_AXIS; "" for none).
    """

    preset: str | None = None
    rules: Mapping[str, str | None] | None = None
    sequence_parallel: bool = False
    update_axis: str | None = None

    def table(self, default_preset: str) -> dict[str, str | None]:
        overrides = dict(self.rules or {})
        if self.sequence_parallel:
            overrides.setdefault("sequence", "model")
        return rules_table(self.preset or default_preset, overrides)

    def optimizer_axis(self, default_preset: str) -> str | None:
        """The mesh axis the optimizer state and update are sharded over, if any."""
        if self.update_axis is not None:
            return self.update_axis or None
        return UPDATE_AXIS.get(self.preset or default_preset)

    def gather_axis(self, default_preset: str) -> str | None:
        """The mesh axis whose weight shards are gathered where a layer uses them, if any."""
        return GATHER_AXIS.get(self.preset or default_preset)

    def trainer_args(self, default_preset: str) -> dict:
        """Keyword arguments of tfpod.trainer.Trainer: table, update_axis, gather_axis."""
        return {"table": self.table(default_preset), "update_axis": self.optimizer_axis(default_preset),
                "gather_axis": self.gather_axis(default_preset)}


# ---------------------------------------------------------------------------
# `with tfpod.sharding(mesh, rules=...):` for Keras users (tfpod/keras.py). This module
# stays a module (`from tfpod import sharding; sharding.shard(...)`); calling it builds
# a tfpod.keras.KerasSharding scope.

import sys as _sys  # noqa: E402
import types as _types  # noqa: E402


class _CallableModule(_types.ModuleType):
    def __call__(self, mesh, rules=None, **kwargs):
        """tfpod.keras.sharding(mesh, rules, preset=..., overrides=..., cover_all=...)."""
        from tfpod import keras

        return keras.sharding(mesh, rules, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
