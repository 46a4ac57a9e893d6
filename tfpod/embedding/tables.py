"""A model's embedding tables on the mesh: lookups and sparse updates on the devices that hold their shards.

A table is a DVariable [rows, width] laid out by the rules like any weight: rows split
over a mesh axis (row-wise), columns split (column-wise, for wide tables), both, or
neither (replicated); or, with sharding.tables='whole', whole on the devices of one
position of its rows' axis (table-wise, on a sub-mesh: tfpod.embedding.whole), where the
other devices hold none of its rows and look up zeros. DTensor has no sparse op on a split
variable ("ResourceGather: DTensor does not support sharded 0th dimension",
"ResourceScatterAdd does not implement layout propagation"), and its functional scatter
gathers the whole table to every device. So the table's shards are reached directly: `dtensor.unpack` of the
DVariable's resource handle gives each local device's own shard as an ordinary
resource, and ordinary TensorFlow functions run on them, one op group per device:

  lookup   before a step: every device gathers, from its own shard, the rows of the
           step's ids that fall in its rows (the global batch's ids, the same on every
           device) and sums each example's (EmbeddingBag); the results are packed into
           a DTensor [row shards, batch, (hot,) width] that the step sums over the row
           shards (tfpod.embedding.layer): the table's row axis reduces the partial
           lookups, and each device's work follows the ids, not the rows.
  apply    after a step: the step returns each table's gradient rows, de-duplicated
           and clipped (tfpod.embedding.executor, homes), replicated; every device updates the
           rows of its shard among them, and their optimizer slots, in place
           (tfpod.embedding.sparse).

Traffic per step and table (B examples, H ids each, width W, S row shards): the ids to
every device (B*H ints, an all-gather across hosts), the partial sums B*W per device
reduced over the S shards, the gradient rows B*H*W gathered to every device; memory
and time per device follow B*H, not the table's rows. Checkpoints, the layout report
and export see the table as the ordinary weight it is.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, compat, runtime
from tfpod.embedding import layer as layer_lib
from tfpod.embedding.sparse import SparseRule, rule_for, sparse_apply
from tfpod.partitioning import submesh
from tfpod.partitioning.rules import layout_for


@dataclasses.dataclass(frozen=True)
class Shard:
    """One local device's piece of a table: rows [lo, hi), columns [col_lo, col_hi)."""

    device: str
    handle: tf.Tensor
    slots: tuple
    lo: int
    hi: int
    col_lo: int
    col_hi: int


@dataclasses.dataclass
class Table:
    """An Embedding layer's table on the mesh, and its shards on this host's devices."""

    layer: layer_lib.TableLayer
    variable: object
    rule: SparseRule | None
    row_axis: str | None
    col_axis: str | None
    shards: list
    pooled: bool | None = None  # a combiner, or one id per example (set at the first lookup)
    marker: object = None  # a whole table's (on a sub-mesh): what the step reads in its place

    @property
    def name(self) -> str:
        return self.layer.name

    def partial_layout(self, rank: int, mesh) -> dtensor.Layout:
        """The layout of the partial lookups [row shards, batch, (hot,) width]."""
        specs = [self.row_axis or dtensor.UNSHARDED] + [dtensor.UNSHARDED] * (rank - 2)
        return dtensor.Layout(specs + [self.col_axis or dtensor.UNSHARDED], mesh)


def find_layers(model) -> list:
    """The model's table layers (tfpod Embeddings, tfpod.keras's sharded Keras Embeddings), each
    once, in tf_keras's traversal order."""
    seen, out = set(), []
    for layer in compat.flatten_layers(model):
        if isinstance(layer, layer_lib.TableLayer) and id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
    return out


def _shards(variable, slots: Sequence, mesh) -> tuple[str | None, str | None, list, bool]:
    """(row axis, column axis, a Shard per local device of `mesh`, whether it is whole) of a
    table: its rows split over the row axis, or (on a sub-mesh, tfpod.embedding.whole) whole
    on the devices at its position of that axis, where every other device holds none of its
    rows (handle None)."""
    inner = compat.inner_variable(variable)
    layout = dtensor.fetch_layout(inner)
    rows, width = inner.shape.as_list()
    handles = dtensor.unpack(inner.handle)
    slot_handles = [dtensor.unpack(compat.inner_variable(s).handle) for s in slots]
    col_axis = None if layout.sharding_specs[1] == dtensor.UNSHARDED else layout.sharding_specs[1]
    per_cols = width // (mesh.dim_size(col_axis) if col_axis else 1)
    at = submesh.position(layout.mesh, mesh)
    placed = at and at[0]
    if placed is not None:
        row_axis, per_rows = placed, rows
        component = {submesh.canonical(d): k for k, d in enumerate(layout.mesh.local_devices())}
    else:
        row_axis = None if layout.sharding_specs[0] == dtensor.UNSHARDED else layout.sharding_specs[0]
        per_rows = rows // (mesh.dim_size(row_axis) if row_axis else 1)
        component = {submesh.canonical(d): k for k, d in enumerate(mesh.local_devices())}
    shards = []
    for device, loc in zip(mesh.local_devices(), mesh.local_device_locations()):
        c = loc[col_axis] if col_axis else 0
        k = component.get(submesh.canonical(device))
        if k is None:  # a whole table's: none of its rows here
            shards.append(Shard(device, None, (), 0, 0, c * per_cols, (c + 1) * per_cols))
            continue
        r = 0 if placed is not None else (loc[row_axis] if row_axis else 0)
        shards.append(Shard(device, handles[k], tuple(h[k] for h in slot_handles), r * per_rows, (r + 1) * per_rows,
                            c * per_cols, (c + 1) * per_cols))
    return row_axis, col_axis, shards, placed is not None


def _shard_lookup(shard: Shard, ids: tf.Tensor, dtype, pooled: bool) -> tf.Tensor:
    """One device's partial lookup: ids [batch, hot] -> [1, batch, width] (pooled) or
    [1, batch, hot, width], from the rows its shard holds (zero elsewhere)."""
    if ids.shape.is_fully_defined():  # (static shapes: fewer ops, which cost more than the work here)
        batch, hot = ids.shape
    else:
        batch, hot = tf.shape(ids)[0], tf.shape(ids)[1]
    width = shard.col_hi - shard.col_lo
    if shard.handle is None:  # no rows of this table here
        return tf.zeros(tf.stack([1, batch, width]) if pooled else tf.stack([1, batch, hot, width]), dtype)
    flat = tf.reshape(ids, [-1])  # [batch * hot]
    where = tf.where((flat >= shard.lo) & (flat < shard.hi))[:, 0]  # positions of the ids this shard holds
    local = tf.gather(flat, where) - tf.cast(shard.lo, flat.dtype)
    rows = tf.raw_ops.ResourceGather(resource=shard.handle, indices=local, dtype=dtype)  # [m, width]
    with tf.control_dependencies([rows]):  # (a gather puts the shard in copy-on-read mode, as the sparse updates do)
        tf.raw_ops.DisableCopyOnRead(resource=shard.handle)
    rows = tf.ensure_shape(rows, [None, width])
    if pooled:
        segments = where if isinstance(hot, int) and hot == 1 else where // tf.cast(hot, where.dtype)
        return tf.math.unsorted_segment_sum(rows, segments, batch)[None]  # [1, batch, width]
    out = tf.scatter_nd(where[:, None], rows, tf.cast(tf.stack([batch * hot, width]), where.dtype))
    return tf.reshape(out, tf.stack([1, batch, hot, width]))


@dataclasses.dataclass
class Held:
    """Every table's partial lookups held in DVariables of their layouts (`Tables.hold`): the
    step reads them and `Tables.apply` (or `Tables.lookup_into`) overwrites them, on each
    device, with the next step's, so no DTensor is packed between steps (a pack costs a
    fixed ~0.1-0.5 ms on the host)."""

    variables: dict  # table name -> DVariable [row shards, batch, (hot,) width]
    handles: list  # per table, per local device: its piece's resource handle

    def read(self) -> dict:
        """{table name: partial lookups}, inside the step's trace."""
        return {name: v.read_value() for name, v in self.variables.items()}


def _write(parts: Sequence, handles: Sequence) -> None:
    """Each device's partial lookups (per table, per device) into its piece of a Held's
    DVariables (per table, per device), on that device."""
    for pieces, held in zip(parts, handles):
        for piece, handle in zip(pieces, held):
            with tf.device(piece.device):
                tf.raw_ops.AssignVariableOp(resource=handle, value=piece)


class Tables:
    """A built, placed model's embedding tables: the host-side lookups and sparse updates.

    Args:
      model: the model (its Embedding layers' tables are DVariables).
      placement: the run's placement (mesh, rules table).
      feature_axes: {feature: logical axes} of the batch (the ids' features among them).
      optimizer: the optimizer whose slots the tables' sparse updates use (None: lookups only).
    """

    def __init__(self, model, placement, feature_axes: Mapping[str, Sequence], optimizer=None):
        self.placement, self.mesh = placement, placement.mesh
        self.feature_axes = feature_axes
        self.tables: list[Table] = []
        for layer in find_layers(model):
            if layer.source is None:
                raise UserError(f"embedding {layer.name}: no `source` (the batch feature holding its ids); the model "
                                "must name it for the sharded lookup")
            variable = layer.embeddings
            rule, slots = None, ()
            if optimizer is not None:
                rule = rule_for(optimizer, variable)
                slots = tuple(optimizer.get_slot(variable, name) for name in rule.slots)
            row_axis, col_axis, shards, whole = _shards(variable, slots, self.mesh)
            marker = None
            if whole:
                # the step's one mesh cannot read the table: its layer reads this scalar instead,
                # and the table's gradient rows come back as the marker's (tfpod.embedding.layer)
                marker = dtensor.DVariable(dtensor.call_with_layout(tf.zeros, dtensor.Layout.replicated(self.mesh, 0),
                                                                    []))
            self.tables.append(Table(layer, variable, rule, row_axis, col_axis, shards, marker=marker))
        self._lookup = tf.function(self._lookups)
        self._lookup_into = tf.function(lambda ids_list, handles: _write(self._lookups(ids_list), handles))
        self._apply = tf.function(self._apply_all)
        self._concrete = {}
        self._compiled = {}

    def __bool__(self) -> bool:
        return bool(self.tables)

    def variables(self) -> dict:
        """{id of a table's DVariable: id of its layer}."""
        return {id(compat.inner_variable(t.variable)): id(t.layer) for t in self.tables}

    # -- lookups --------------------------------------------------------------

    def global_ids(self, host_batch: Mapping[str, np.ndarray], leading_dims: int = 0) -> list:
        """Each table's ids for the whole global batch, [*leading, batch, hot] (a collective
        across hosts; `leading_dims`: a loop's stacked steps before the batch)."""
        features = sorted({t.layer.source for t in self.tables})
        for f in features:
            if f not in host_batch:
                raise UserError(f"embedding tables: the batch has no feature {f!r} (a table's `source`); it has "
                                f"{', '.join(sorted(host_batch))}")
        if runtime.info().num_clients == 1:
            found = {f: layer_lib.padded_ids(host_batch[f]).numpy() if isinstance(host_batch[f], tf.RaggedTensor)
                     else np.asarray(host_batch[f]) for f in features}
        else:  # the other hosts' rows: relaid out replicated on the mesh, read on this host's first device
            key = ("spread", leading_dims)
            if key not in self._compiled:
                layouts = {f: dtensor.Layout.replicated(self.mesh, leading_dims + len(self.feature_axes[f]))
                           for f in features}
                self._compiled[key] = tf.function(lambda b: {f: dtensor.relayout(b[f], layouts[f]) for f in features})
            spread = self._compiled[key](self.placement.to_global({f: host_batch[f] for f in features},
                                                                   self.feature_axes, leading_dims=leading_dims))
            found = {f: dtensor.unpack(v)[0] for f, v in spread.items()}
        return self.shaped_ids([found[t.layer.source] for t in self.tables], leading_dims)

    def shaped_ids(self, ids_list: Sequence, leading_dims: int = 0) -> list:
        """Each table's global ids as `lookup_ids` takes them: [*leading, batch, hot] (one id per
        example as hot 1); the first call fixes whether each table pools."""
        out = []
        for t, ids in zip(self.tables, ids_list):
            pooled = t.layer.combiner is not None or len(ids.shape) == leading_dims + 1
            if t.pooled is not None and t.pooled != pooled:
                raise UserError(f"embedding {t.name}: its ids changed rank between steps ({t.layer.source!r})")
            t.pooled = pooled
            out.append(ids[..., None] if len(ids.shape) == leading_dims + 1 else ids)
        return out

    def _lookups(self, ids_list, after=None) -> list:
        """Every table's partial lookups on every local device (inside an ordinary tf.function),
        after the ops `after[k]` of device k."""
        out = []
        for table, ids in zip(self.tables, ids_list):
            parts = []
            for k, shard in enumerate(table.shards):
                with tf.device(shard.device), tf.control_dependencies(after[k] if after else []):
                    parts.append(_shard_lookup(shard, ids, table.variable.dtype, table.pooled))
            out.append(parts)
        return out

    def _pack(self, parts) -> dict:
        return {table.name: dtensor.pack(pieces, table.partial_layout(len(pieces[0].shape), self.mesh))
                for table, pieces in zip(self.tables, parts)}

    def lookup(self, host_batch: Mapping[str, np.ndarray]) -> dict:
        """The partial lookups of every table for this batch, as DTensors
        {table name: [row shards, batch, (hot,) width]} for `scope`."""
        return self.lookup_ids(self.global_ids(host_batch))

    def lookup_ids(self, ids_list: Sequence) -> dict:
        """`lookup` of each table's global ids (`global_ids`)."""
        return self._pack(self._lookup(list(ids_list)))

    def hold(self, ids_list: Sequence) -> Held:
        """New DVariables holding the partial lookups of these global ids (`lookup_ids`'), which
        `lookup_into` and `apply(..., into=)` overwrite with later ones of the same shapes."""
        partials = self.lookup_ids(ids_list)
        variables = {t.name: dtensor.DVariable(partials[t.name], trainable=False) for t in self.tables}
        return Held(variables, [dtensor.unpack(variables[t.name].handle) for t in self.tables])

    def lookup_into(self, ids_list: Sequence, into: Held) -> None:
        """`lookup_ids` written straight into `into` (`hold`'s, for ids of the same shapes)."""
        self._lookup_into(list(ids_list), into.handles)

    def scope(self, partials: Mapping[str, tf.Tensor]) -> layer_lib.LookupScope:
        """The lookup scope a step's trace enters with these partial lookups (DTensors)."""
        table = self.placement.table
        scope = layer_lib.LookupScope(
            {id(t.layer): partials[t.name] for t in self.tables},
            {id(t.layer): layout_for(("batch",) + (None,) * (len(partials[t.name].shape) - 2), table, self.mesh)
             for t in self.tables})
        scope.table_layers.update(self.variables())
        scope.markers.update({id(t.layer): t.marker for t in self.tables if t.marker is not None})
        return scope

    # -- sparse updates ---------------------------------------------------------

    def _apply_all(self, ids_list, rows_list, hyper_list, next_ids=None, into=None):
        ops = [[] for _ in self.mesh.local_devices()]
        for k in range(len(ops)):
            hyper = hyper_list[k]
            lr, finite, step = hyper[0], hyper[1] > 0, hyper[2]
            for table, ids, rows in zip(self.tables, ids_list, rows_list):
                shard = table.shards[k]
                if shard.handle is None:  # no rows of this table here
                    continue
                with tf.device(shard.device):
                    # (where + gather: half of boolean_mask's ops, which cost more than the work here)
                    mine = tf.where((ids[k] >= shard.lo) & (ids[k] < shard.hi) & finite)[:, 0]
                    local = tf.gather(ids[k], mine) - shard.lo
                    grads = tf.gather(rows[k], mine)
                    if (shard.col_lo, shard.col_hi) != (0, rows[k].shape[1]):
                        grads = grads[:, shard.col_lo:shard.col_hi]
                    applied = sparse_apply(table.rule, shard.handle, shard.slots, local, grads, lr, step)
                    with tf.control_dependencies([applied]):
                        # the sparse kernels put the shard in copy-on-read mode, where every read of
                        # the table (the step's, a checkpoint's) would copy it: back to sharing
                        ops[k].append(tf.raw_ops.DisableCopyOnRead(resource=shard.handle))
        if next_ids is None:
            tf.group(ops)
            return None
        parts = self._lookups(next_ids, after=ops)
        if into is None:
            return parts
        _write(parts, into)
        return None

    def apply(self, rows: Sequence[tuple], hyper: tf.Tensor, next_ids: Sequence | None = None,
              into: Held | None = None) -> dict | None:
        """Applies a step's gradient rows to the shards on this host's devices, in place, and
        with `next_ids` looks up the next step's partials in the same call.

        Args:
          rows: per table, (ids [n], values [n, width]) de-duplicated and clipped, replicated DTensors.
          hyper: [learning rate, 1 if the step was finite else 0, step from 1], a replicated DTensor.
          next_ids: the next step's global ids (`global_ids`), or None.
          into: where the next step's partials go (`hold`), their shapes as these ids'; None:
            returned, packed.

        Returns:
          The next step's partial lookups (as `lookup`), or None (also when held `into`).
        """
        return self.apply_local([(dtensor.unpack(i), dtensor.unpack(v)) for i, v in rows], dtensor.unpack(hyper),
                                next_ids, into)

    def apply_local(self, rows: Sequence[tuple], hyper: Sequence, next_ids: Sequence | None = None,
                    into: Held | None = None) -> dict | None:
        """`apply` of the rows' and hyper's components: per table (ids, values), each a list of
        one tensor per local device, and hyper's list."""
        into = None if next_ids is None else into
        # (its concrete function per shapes, called directly: no matching of the arguments each step)
        key = (tuple((tuple(i[0].shape), tuple(v[0].shape)) for i, v in rows),
               None if next_ids is None else tuple(tuple(i.shape) for i in next_ids), into is None)
        args = ([i for i, _ in rows], [v for _, v in rows], list(hyper), None if next_ids is None else list(next_ids),
                None if into is None else into.handles)
        if key not in self._concrete:
            self._concrete[key] = compat.flat_caller(self._apply.get_concrete_function(*args), *args)
        parts = self._concrete[key](*args)
        return None if parts is None or into is not None else self._pack(parts)
