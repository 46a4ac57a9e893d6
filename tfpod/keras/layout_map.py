"""Rules -> layouts for a user's tf_keras variables: `tfpod.sharding(mesh, rules=...)`.

`KerasSharding` is a tf_keras LayoutMap whose layouts come from tfpod's rules engine
(`tfpod.sharding.resolve`) instead of first-match regexes; `get_values` / `set_values`
copy (sharded) variables to and from host arrays.
"""

from __future__ import annotations

import logging
from typing import Mapping

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tfpod import UserError, compat
from tfpod import partitioning as shardinglib
from tfpod.attention import AttentionConfig
from tfpod.keras import support

log = logging.getLogger("tfpod")

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


class KerasSharding(compat.layout_map_lib().LayoutMap):
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
      attention: what the model's MultiHeadAttention layers attend with under fit, evaluate
        and predict (tfpod.attention.AttentionConfig; default: blockwise, 512-token blocks).
    """

    def __init__(self, mesh: dtensor.Mesh, rules=None, preset: str = "tensor",
                 overrides: Mapping[str, str | None] | None = None, cover_all: bool = False,
                 attention: AttentionConfig | None = None):
        if not isinstance(mesh, dtensor.Mesh):
            raise UserError(
                f"tfpod.sharding: mesh is a {type(mesh).__name__}, not a dtensor.Mesh: make one with "
                "tfpod.make_mesh('data:-1,model:2')"
            )
        if shardinglib.CONTEXT_AXIS in mesh.dim_names and mesh.dim_size(shardinglib.CONTEXT_AXIS) > 1:
            raise UserError(
                f"tfpod.sharding: the mesh's `{shardinglib.CONTEXT_AXIS}` axis (context parallelism) splits the sequence "
                "of tfpod's own decoders (main.py's gpt, llama), which read their tokens' positions in its balanced "
                "order; a Keras model under fit cannot: use a mesh without it, e.g. tfpod.make_mesh('data:-1,model:2')")
        if attention is not None and not isinstance(attention, AttentionConfig):
            raise UserError(f"tfpod.sharding: attention is a {type(attention).__name__}, not a "
                            "tfpod.attention.AttentionConfig: e.g. AttentionConfig('materialized')")
        super().__init__(mesh=mesh)
        self.mesh, self.attention = mesh, attention
        self.rules = _parse_rules(rules, mesh)
        resolved = shardinglib.get_preset(preset)
        self.table = shardinglib.rules_table(resolved, overrides)
        resolved.check_keras(self.table, mesh)
        # Mesh axes named directly in a rule map to themselves.
        for r in self.rules:
            for a in r.axes:
                if a is not None and a not in shardinglib.LOGICAL_AXES:
                    self.table[a] = a
        shardinglib.check_mesh_axes(mesh, self.table, preset=preset,
                                    fix="name it in a rule (e.g. rules={'dense\\.kernel': (None, '<axis>')}) or in "
                                        "overrides=")
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
        # DTensor initializers need tf.random.Generator-based Keras random ops.
        tf_keras.backend.experimental.enable_tf_random_generator()
        self._scope = compat.layout_map_lib().layout_map_scope(self)
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


def in_scope() -> bool:
    """Whether the code runs inside `with tfpod.sharding(...)` (a KerasSharding is tf_keras's current layout map)."""
    return isinstance(compat.layout_map_lib().get_current_layout_map(), KerasSharding)


def sharding(mesh: dtensor.Mesh, rules=None, *, preset: str = "tensor",
             overrides: Mapping[str, str | None] | None = None, cover_all: bool = False,
             attention: AttentionConfig | None = None) -> KerasSharding:
    """`with tfpod.sharding(mesh, rules=...):` build a tf_keras model with sharded DVariables.

    See KerasSharding for the arguments. The rules are checked now; each variable is
    checked as it is placed; `model.compile` then checks that every rule matched.

    Returns:
      The KerasSharding (a context manager; `report()` gives the layout report).
    """
    return KerasSharding(mesh, rules, preset=preset, overrides=overrides, cover_all=cover_all, attention=attention)


def layout_of(variable) -> dtensor.Layout:
    """The DTensor layout of a (sharded) model variable."""
    support.refuse_keras3(variable, "tfpod.keras.layout_of")
    return dtensor.fetch_layout(compat.inner_variable(variable))


def get_values(variables) -> list:
    """Host numpy copies of (sharded) DVariables or DTensors: each gathered to a replicated value first.

    DTensor cannot copy a sharded tensor to the host (`.numpy()` of a split weight
    fails), so the sharded model's `get_weights` goes through here; it works on
    every host of a multi-host job.
    """
    variables = list(variables)
    support.refuse_keras3(variables, "tfpod.keras.get_values")
    out = []
    for v in variables:
        inner = compat.inner_variable(v)
        value = inner.read_value() if isinstance(inner, tf.Variable) else tf.convert_to_tensor(inner)
        layout = dtensor.fetch_layout(value)
        if not layout.is_fully_replicated():
            value = dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank))
        out.append(dtensor.unpack(value)[0].numpy())
    return out


def set_values(variables, values) -> None:
    """Assigns host values to (sharded) DVariables, each relaid out to its variable's layout."""
    variables = list(variables)
    support.refuse_keras3(variables, "tfpod.keras.set_values")
    values = list(values)
    if len(values) != len(variables):
        raise UserError(f"set_weights: got {len(values)} values for {len(variables)} weights")
    for v, value in zip(variables, values):
        inner = compat.inner_variable(v)
        layout = dtensor.fetch_layout(inner)
        value = tf.convert_to_tensor(value, dtype=inner.dtype)
        if value.shape != inner.shape:
            raise UserError(f"set_weights: weight {inner.name} has shape {inner.shape}, got a value of shape {value.shape}")
        replicated = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(layout.mesh, value.shape.rank))
        inner.assign(dtensor.relayout(replicated, layout))




def is_dvariable(v) -> bool:
    try:
        dtensor.fetch_layout(v)
        return True
    except Exception:  # noqa: BLE001 - fetch_layout raises several types for non-DTensors
        return False
