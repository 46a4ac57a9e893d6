"""Table-wise placement (`sharding.tables='whole'`): each table whole on the devices of one
position of the mesh axis its rows map to, the tables balanced over the positions by bytes.

DTensor splits a tensor in equal pieces over every device of an axis, so a whole table on
some devices is a DVariable on a sub-mesh: the devices of the main mesh at one position
of the axis (that axis of size 1, the others as on the main mesh), the table replicated
there (its columns split as the rules say, over the other axes). Its optimizer slots
follow it (optimizers.create_state lays a slot out as its variable). The lookups and
sparse updates already run outside the DTensor program on each device's own piece
(tfpod.embedding.tables): the devices at the table's position gather from it and the
others add zeros, so the step sums the partial lookups over the axis exactly as for a
table split by rows. The step never reads the table (one DTensor program takes one
mesh's variables): its layer reads a scalar marker on the step's mesh instead, through
which the table's gradient rows flow back (tfpod.embedding.executor).

Positions are chosen greedily, largest table first, each to the position holding the
fewest bytes so far (ties: the lowest position), as TorchRec's greedy table-wise planner
does; a table's bytes count it and its optimizer slots alike, so weights are enough.
Checkpoints hold each table under its own name and shape, so they move between
table-wise and row-wise placements and between meshes.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.partitioning import submesh


def positions(table_bytes: Mapping[str, int], size: int) -> dict[str, int]:
    """{table: its position on the axis}: largest first, each to the least-loaded position."""
    load = [0] * size
    out = {}
    for name in sorted(table_bytes, key=lambda n: (-table_bytes[n], n)):
        p = int(np.argmin(load))
        out[name] = p
        load[p] += table_bytes[name]
    return out


def heaviest(table_bytes: Mapping[str, int], size: int) -> list[str]:
    """The tables `positions` puts at the most loaded position (ties: the lowest), sorted."""
    where = positions(table_bytes, size)
    load = [0] * size
    for name, p in where.items():
        load[p] += table_bytes[name]
    top = int(np.argmax(load))
    return sorted(n for n, p in where.items() if p == top)


def row_axes(names: Sequence[str], main: Mapping[str, dtensor.Layout]) -> dict[str, str]:
    """{table: the mesh axis its rows are split over by the rules}, for the tables the rules split.

    Raises:
      UserError: no table's rows map to a mesh axis (nothing to place whole over).
    """
    axes = {n: main[n].sharding_specs[0] for n in names if main[n].sharding_specs[0] != dtensor.UNSHARDED}
    if not axes:
        raise UserError("sharding.tables='whole': no table's rows map to a mesh axis on this mesh, so there are no "
                        "positions to place them on; map their rows' logical axis to one (e.g. "
                        "sharding.rules={'vocab': 'data'}), or use sharding.tables='rows'")
    return axes


def layouts(names: Sequence[str], main: Mapping[str, dtensor.Layout], shapes: Mapping[str, tuple],
            itemsize: Mapping[str, int], mesh: dtensor.Mesh) -> dict[str, dtensor.Layout]:
    """{table: its layout on its position's sub-mesh}, from the tables' layouts by the rules.

    Args:
      names: the tables' variable names.
      main: their layouts by the rules on `mesh` (rows over the axis to place them on).
      shapes, itemsize: their shapes and bytes per element.
      mesh: the main mesh.

    Tables whose rows the rules do not split keep their layouts (replicated, or columns split).

    Raises:
      UserError: no table's rows map to a mesh axis (nothing to place whole over).
    """
    axes = row_axes(names, main)
    out = {}
    for axis in sorted(set(axes.values())):
        if mesh.dim_size(axis) == 1:  # one position: the table is whole on every device already
            continue
        group = [n for n in names if axes.get(n) == axis]
        where = positions({n: int(np.prod(shapes[n])) * itemsize[n] for n in group}, mesh.dim_size(axis))
        meshes = {p: submesh.at(mesh, axis, p) for p in sorted(set(where.values()))}
        for n in group:
            out[n] = dtensor.Layout([dtensor.UNSHARDED] + list(main[n].sharding_specs[1:]), meshes[where[n]])
    return out
