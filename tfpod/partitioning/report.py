"""The layout report: every variable's global shape, layout and bytes per device, and totals."""

from __future__ import annotations

import collections
import math
from typing import Iterable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod.partitioning import submesh
from tfpod.partitioning.rules import VarSpec, shape_text

# Layout report


def bytes_per_device(shape: Sequence[int], dtype: tf.DType, layout: dtensor.Layout) -> int:
    """Bytes one device holds of a tensor with this global shape and layout."""
    local = [
        d if spec == dtensor.UNSHARDED else d // layout.mesh.dim_size(spec)
        for d, spec in zip(shape, layout.sharding_specs)
    ]
    return math.prod(local) * tf.as_dtype(dtype).size


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def bytes_by_device(specs: Iterable[VarSpec], layouts: Mapping[str, dtensor.Layout], mesh: dtensor.Mesh) -> list[int]:
    """The bytes each device of `mesh` holds of these variables (in the mesh's device order):
    each variable's bytes per device on every device of `mesh`, or where it lies on a sub-mesh
    at one position of an axis (an embedding table placed whole) on the devices there."""
    held = collections.Counter()  # everywhere (None), and per (axis, position) of a sub-mesh
    for s in specs:
        held[submesh.position(layouts[s.name].mesh, mesh)] += bytes_per_device(s.shape, s.dtype, layouts[s.name])
    names = list(mesh.dim_names)
    out = []
    for c in np.ndindex(*[mesh.dim_size(n) for n in names]):
        loc = dict(zip(names, c))
        out.append(sum(b for k, b in held.items() if k is None or loc[k[0]] == k[1]))
    return out


def most_bytes(specs: Iterable[VarSpec], layouts: Mapping[str, dtensor.Layout], mesh: dtensor.Mesh) -> int:
    """The most bytes any one device of `mesh` holds of these variables (`bytes_by_device`)."""
    return max(bytes_by_device(specs, layouts, mesh), default=0)


def layout_report(
    specs: Iterable[VarSpec],
    layouts: Mapping[str, dtensor.Layout],
    title: str = "variables",
    stages: Sequence[dtensor.Mesh] = (),
) -> str:
    """A table: variable, global shape, layout, bytes per device; then totals.

    With pipeline `stages` (their meshes), a stage column, the mesh shown as
    `stage:N,<each stage's axes>`, and each stage's totals per device.
    """
    specs = list(specs)
    stage_of = {}
    if stages:
        from tfpod.partitioning.stages import stage_index

        stage_of = {s.name: stage_index(layouts[s.name], stages) for s in specs}
    mesh = max((layouts[s.name].mesh for s in specs), key=lambda m: m.size, default=None)
    # variables on a sub-mesh at one position of an axis (embedding tables placed whole)
    at = {} if stages or mesh is None else {s.name: submesh.position(layouts[s.name].mesh, mesh) for s in specs}
    rows = []
    total_params = total_bytes = 0
    for s in specs:
        layout = layouts[s.name]
        per_dev = bytes_per_device(s.shape, s.dtype, layout)
        n = math.prod(s.shape)
        total_params += n
        total_bytes += n * s.dtype.size
        where = at.get(s.name)
        text = "[" + ", ".join(layout.sharding_specs) + "]" + (f" on {where[0]}={where[1]}" if where else "")
        row = (s.name, shape_text(s.shape), text, human_bytes(per_dev))
        rows.append(row + ((str(stage_of[s.name]),) if stages else ()))
    header = ("variable", "global shape", "layout", "bytes/device") + (("stage",) if stages else ())
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    axes = ",".join(f"{n}:{mesh.dim_size(n)}" for n in mesh.dim_names) if mesh else ""
    if stages:
        axes = f"stage:{len(stages)},{axes}"
    lines = [
        f"# {title}" + (f" on mesh {axes}" if mesh else ""),
        "  ".join(h.ljust(w) for h, w in zip(header, widths)),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    per_stage = [sum(bytes_per_device(s.shape, s.dtype, layouts[s.name]) for s in specs if stage_of[s.name] == i)
                 for i in range(len(stages))]
    lines.append(
        f"# total: {len(specs)} variables, {total_params:,} parameters, {human_bytes(total_bytes)}; "
        f"per device: {human_bytes(max(per_stage) if stages else most_bytes(specs, layouts, mesh) if mesh else 0)}"
        + (" (the largest stage)" if stages else " (the most any device holds)" if any(at.values()) else "")
    )
    for i in range(len(stages)):
        held = [s for s in specs if stage_of[s.name] == i]
        lines.append(f"# stage {i}: {len(held)} variables, {sum(math.prod(s.shape) for s in held):,} parameters; "
                     f"per device: {human_bytes(per_stage[i])}")
    for axis in (mesh.dim_names if mesh else []):
        split = [s for s in specs if axis in layouts[s.name].sharding_specs]
        if split:
            names = ", ".join(s.name for s in split[:6]) + (f", ... ({len(split) - 6} more)" if len(split) > 6 else "")
            lines.append(f"# split over {axis!r}: {len(split)} of {len(specs)} variables: {names}")
    return "\n".join(lines) + "\n"
