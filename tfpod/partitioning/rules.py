"""Partitioning rules as data: logical axes, presets, variable-path rules, validation.

Models name the dimensions of their variables with *logical axes*; variable-path rules
(regex over the variable name) give logical axes to variables of layers we do not
write; one *rules table* maps each logical axis to a mesh axis (or to nothing:
replicated). `resolve` checks every variable against the rules before anything is
allocated and returns its layout. See tfpod.partitioning for the presets.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Mapping, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.partitioning.presets import Preset, get_preset

LOGICAL_AXES = ("batch", "length", "sequence", "height", "embed", "heads", "kv_heads", "kv", "mlp", "vocab", "expert")
# Logical axes whose dimension is replicated where it does not divide over its mesh axis
# instead of refused: grouped-query attention's key/value heads (Megatron replicates them
# when the tensor-parallel size exceeds their count).
SPLIT_WHEN_DIVISIBLE = ("kv_heads",)

AxisNames = tuple  # tuple[str | None, ...]: one logical axis (or None) per dimension

# The mesh axis of context parallelism: on a mesh with it, the activations' sequence axes
# (`length` inside blocks, `sequence` between them) are split over it (docs/attention.md).
CONTEXT_AXIS = "context"



@dataclasses.dataclass(frozen=True)
class AxisRule:
    """Variables whose name matches `pattern` (re.fullmatch) have these logical axes.

    `optional`: the rule is for a weight some configurations leave out (Qwen2's query/key/
    value biases, an untied output layer), so matching no variable is not an error.
    """

    pattern: str
    axes: AxisNames
    optional: bool = False

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

    def axes_for(self, shape) -> tuple:
        """The logical axes of a matched variable of this shape (a derived rule's depend on it:
        tfpod.lora's adapters)."""
        return self.axes


@dataclasses.dataclass(frozen=True)
class VarSpec:
    """A variable before allocation: its name (no ':0'), global shape, dtype, and whether it trains."""

    name: str
    shape: tuple
    dtype: tf.DType = tf.float32
    trainable: bool = True


def rules_table(preset: str | Preset, overrides: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """The logical->mesh axis table of a preset, with user overrides applied.

    Args:
      preset: a Preset, or a registered preset's name (tfpod.partitioning.presets).
      overrides: {logical_axis: mesh_axis or None} replacing the preset's entries.

    Raises:
      UserError: unknown preset, or an unknown logical axis in the preset or the overrides.
    """
    preset = preset if isinstance(preset, Preset) else get_preset(preset)
    table = {a: None for a in LOGICAL_AXES}
    for logical, mesh_axis in preset.table.items():
        if logical not in LOGICAL_AXES:
            raise UserError(f"sharding.preset={preset.name!r}: its table names unknown logical axis {logical!r}; use one "
                            f"of {', '.join(LOGICAL_AXES)}")
        table[logical] = mesh_axis
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


def layout_for(axes: Sequence[str | None], table: Mapping[str, str | None], mesh: dtensor.Mesh,
               shape: Sequence[int | None] | None = None) -> dtensor.Layout:
    """The DTensor layout of a tensor whose dimensions have these logical axes.

    A logical axis mapped to a mesh axis the mesh lacks is replicated; a mesh axis
    already used by an earlier dimension of the same tensor is not used again; with the
    tensor's `shape`, a dimension of a SPLIT_WHEN_DIVISIBLE axis that does not divide is
    replicated.
    """
    used = set()
    specs = []
    for i, a in enumerate(axes):
        mesh_axis = table.get(a) if a is not None else None
        if (a in SPLIT_WHEN_DIVISIBLE and shape is not None and mesh_axis in mesh.dim_names and shape[i]
                and shape[i] % mesh.dim_size(mesh_axis)):
            mesh_axis = None
        if mesh_axis is not None and mesh_axis in mesh.dim_names and mesh_axis not in used:
            used.add(mesh_axis)
            specs.append(mesh_axis)
        else:
            specs.append(dtensor.UNSHARDED)
    return dtensor.Layout(specs, mesh)


def shape_text(shape) -> str:
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
    undivided = {}  # (logical axis, size, mesh axis): the first variable's message, and how many share it
    for s in specs:
        hits = [r for r in axis_rules if r.matches(s.name)]
        if len(hits) > 1:
            raise UserError(
                f"variable {s.name} {shape_text(s.shape)} is matched by two sharding rules, "
                f"{hits[0].pattern!r} and {hits[1].pattern!r}: narrow one so each variable has one rule"
            )
        if not hits:
            raise UserError(
                f"variable {s.name} {shape_text(s.shape)} matches no sharding rule: add a rule "
                f"(regex, logical axes) for it, e.g. ({re.escape(s.name)!r}, {(None,) * len(s.shape)!r})"
            )
        rule = hits[0]
        used_rules.add(rule)
        axes = rule.axes_for(s.shape)
        if len(axes) != len(s.shape):
            raise UserError(
                f"variable {s.name} {shape_text(s.shape)} has rank {len(s.shape)} but rule "
                f"{rule.pattern!r} gives {len(axes)} logical axes {axes}: give one axis per dimension"
            )
        layout = layout_for(axes, table, mesh, s.shape)
        for dim, (size, mesh_axis) in enumerate(zip(s.shape, layout.sharding_specs)):
            if mesh_axis != dtensor.UNSHARDED and size % mesh.dim_size(mesh_axis):
                key = (axes[dim], size, mesh_axis)
                first, count = undivided.get(key, (
                    f"variable {s.name} {shape_text(s.shape)}: dimension {dim} ({axes[dim]}, size {size}) "
                    f"does not divide over mesh axis {mesh_axis!r} of size {mesh.dim_size(mesh_axis)} "
                    f"(rule {rule.pattern!r})", 0))
                undivided[key] = (first, count + 1)
        layouts[s.name] = layout
    if undivided:  # every problem at once: one run to learn them all
        parts = [first + (f" (and {count - 1} more variable(s) alike)" if count > 1 else "")
                 for first, count in undivided.values()]
        axes = ", ".join(sorted({repr(a) for a, _, _ in undivided}))
        raise UserError("; ".join(parts) + f": change the model size, the mesh, or map {axes} to no mesh axis in "
                        "sharding.rules")
    unused = [r for r in axis_rules if r not in used_rules and not r.optional]
    if unused:
        raise UserError(
            f"sharding rule {unused[0].pattern!r} {unused[0].axes} matches no variable: fix its "
            "regex (it must match a whole variable name, see layouts.txt) or remove it"
        )
    return layouts
