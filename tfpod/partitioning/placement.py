"""One run's placement on the mesh: the mesh, the rules table, the update and gather axes,
and the data layout (which rows of the global batch each host holds and feeds).

Every host holds the rows of the global batch that belong to its own devices' shards
of the batch axis, in shard order: `host_rows` is how many (global_batch / hosts when
hosts own whole shards). `to_global` packs a host's rows as the local components of
DTensors over the global mesh (`dtensor.pack`), so no host ever builds or sends the
whole global batch; `to_host` is its inverse (this host's rows of a batch-sharded
tensor, in the order the host fed them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.partitioning.step_context import activation_sharding, within
from tfpod.partitioning.presets import Preset
from tfpod.partitioning.context import zigzag
from tfpod.partitioning.rules import CONTEXT_AXIS, check_mesh_axes, layout_for
from tfpod.partitioning.sharding_config import ShardingConfig


def batch_mesh_axis(axes: Sequence[str | None], table: Mapping[str, str | None], mesh) -> str | None:
    """The mesh axis the first (batch) dimension of a feature with these logical axes is split over."""
    spec = layout_for(axes, table, mesh).sharding_specs
    return None if spec[0] == dtensor.UNSHARDED else spec[0]


def local_shards(mesh: dtensor.Mesh, batch_axis: str | None) -> list[int]:
    """Indices (along the batch mesh axis) of the batch shards this host's devices hold."""
    if batch_axis is None:
        return [0]
    return sorted({loc[batch_axis] for loc in mesh.local_device_locations()})


def split_microbatches(host_batch: Mapping[str, np.ndarray], microbatches: int, local_shards: int,
                       leading_dims: int = 0) -> dict[str, np.ndarray]:
    """A host batch [*leading, rows, ...] as [*leading, microbatches, rows / microbatches, ...].

    The host's rows are `local_shards` equal blocks, one per batch shard it feeds;
    microbatch i takes the i-th slice of every block, so each microbatch is split over
    the batch axis like the whole batch.
    """
    out = {}
    for name, value in host_batch.items():
        value = np.asarray(value)
        lead, rows, rest = value.shape[:leading_dims], value.shape[leading_dims], value.shape[leading_dims + 1:]
        per = rows // local_shards // microbatches
        blocks = value.reshape(lead + (local_shards, microbatches, per) + rest)  # [*lead, shards, M, per, ...]
        out[name] = np.swapaxes(blocks, leading_dims, leading_dims + 1).reshape(
            lead + (microbatches, local_shards * per) + rest)
    return out


def check_microbatches(global_batch: int, batch_shards: int, microbatches: int) -> None:
    """The per-shard batch must divide into the microbatches (one UserError line otherwise)."""
    per_shard = global_batch // batch_shards
    if per_shard % microbatches:
        raise UserError(f"train.microbatches={microbatches} does not divide the {per_shard} examples each batch shard "
                        f"holds (train.global_batch_size={global_batch} over {batch_shards} shards): use a divisor "
                        f"of {per_shard}, or a larger global batch")


def host_rows(global_batch: int, mesh: dtensor.Mesh, batch_axis: str | None, num_hosts: int | None = None) -> int:
    """Rows of the global batch this host must supply.

    Args:
      num_hosts: hosts in the job (None: DTensor's client count).

    Raises:
      UserError: the global batch does not divide over the batch axis or the hosts, or
        the batch axis does not divide over the hosts (two hosts would feed one shard
        from different data).
    """
    shards = mesh.dim_size(batch_axis) if batch_axis else 1
    hosts = num_hosts or dtensor.num_clients()
    if global_batch % hosts:
        raise UserError(f"train.global_batch_size={global_batch} does not divide over the {hosts} hosts: "
                        f"use a multiple of {hosts * shards // math.gcd(hosts, shards)}")
    if global_batch % shards:
        raise UserError(
            f"train.global_batch_size={global_batch} does not divide over mesh axis "
            f"{batch_axis!r} of size {shards}: use a multiple of {shards}"
        )
    if hosts > 1 and shards % hosts:
        raise UserError(f"mesh axis {batch_axis or 'data'!r} of size {shards} does not divide over the {hosts} "
                        f"hosts, so hosts would feed the same batch shard from different files: make it a multiple "
                        f"of {hosts} (e.g. --mesh=data:-1 with the model axis within a host)")
    return global_batch // shards * len(local_shards(mesh, batch_axis))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's weights, optimizer state, activations and batches live.

    Attributes:
      mesh: the global mesh.
      table: logical axis -> mesh axis (rules.rules_table).
      update_axis: mesh axis the optimizer state and update are sharded over (None: laid
        out like each weight).
      gather_axis: mesh axis whose weight shards are gathered where a layer uses them
        (the `2d` preset; None: weights are used as stored).
      stages: the pipeline stages' sub-meshes (tfpod.partitioning.stages), first to last;
        empty without a `stage` axis. `mesh` is then the first stage's: every host has
        devices in every stage, so host-wide collectives and the data layout use it.
      preset: the Preset the table came from (its checks: Preset.check_run); a placement
        built by hand gets a Preset named 'custom' of its own table and axes, so every
        placement's run is checked the same way.
      attention: the attention kernel every step compiled here traces with
        (tfpod.attention.AttentionConfig, gin `attention.*`; None: its defaults), a field
        of the step context like the mesh and the table.
      tables: embedding tables split by "rows" over their axis, or "whole" on its
        positions (table-wise; ShardingConfig.tables).
    """

    mesh: dtensor.Mesh
    table: Mapping[str, str | None]
    update_axis: str | None = None
    gather_axis: str | None = None
    stages: tuple = ()
    preset: Preset | None = None
    attention: Any = None
    tables: str = "rows"

    def __post_init__(self):
        if self.preset is None:
            object.__setattr__(self, "preset", Preset("custom", dict(self.table), "a placement built by hand",
                                                      self.update_axis, self.gather_axis, searched=False))

    @property
    def num_stages(self) -> int:
        return max(1, len(self.stages))

    def stage(self, index: int) -> "Placement":
        """This placement on one stage's mesh (itself without stages)."""
        if not self.stages:
            return self
        return dataclasses.replace(self, mesh=self.stages[index], stages=())

    def stage_activations(self, index: int) -> contextlib.AbstractContextManager:
        """One stage's block of a pipelined step's trace: the step's context on the stage's mesh.

        Raises:
          RuntimeError: no step is being traced.
        """
        return within(f"stage_activations({index})", mesh=self.stage(index).mesh, stage=index)

    @classmethod
    def from_config(cls, config: ShardingConfig, default_preset: str, mesh, check: bool = True,
                    attention=None) -> Placement:
        """The placement `sharding.*` asks for on `mesh` (or on a list of pipeline stages'
        meshes), its steps attending with `attention` (gin `attention.*`; None: the
        defaults); a mesh axis nothing uses is an error (`check`)."""
        stages = tuple(mesh) if isinstance(mesh, (list, tuple)) else ()
        if stages:
            mesh = stages[0]
        preset = config.preset_for(default_preset)
        placement = cls(mesh, config.table(preset, mesh.dim_names), config.update_axis_of(preset), preset.gather_axis,
                        stages if len(stages) > 1 else (), preset, attention, config.tables)
        if config.sequence_parallel and CONTEXT_AXIS in mesh.dim_names and placement.table.get("sequence") == CONTEXT_AXIS:
            logging.getLogger("tfpod").warning("sharding.sequence_parallel=True on a mesh with a `context` axis: the stream between "
                            "blocks is split along the sequence over `context` already, not also over `model` "
                            "(one dimension splits over one mesh axis); set sequence_parallel=False to silence this")
        if check:
            check_mesh_axes(mesh, placement.table, (placement.update_axis, placement.gather_axis),
                            preset=preset.name,
                            fix="map a logical axis to it with sharding.rules (e.g. {'mlp': '<axis>'})")
        return placement

    def activations(self, microbatches: int = 1) -> contextlib.AbstractContextManager:
        """A step's context on this placement (partitioning.step_context.StepContext): within
        it models' activation annotations relayout on this mesh, and attention traces with
        this placement's."""
        return activation_sharding(self.mesh, self.table, microbatches, attention=self.attention)

    def compile(self, fn: Callable, microbatches: int = 1) -> Callable:
        """`fn` as a tf.function (traced as written, no autograph) that is traced and run only
        inside this placement's step context (`activations`): the one point where a step
        learns the mesh and table its annotations (`shard`, `split`, `replicate`) lay
        activations out on, how many microbatches it accumulates, and its attention kernel.
        The result keeps `experimental_get_tracing_count`, and `concrete(*args)` gives the
        concrete function for such arguments (traced here once): calling it skips
        tf.function's matching of the arguments to its traces (about 1 ms a call of a step
        with a dozen inputs), for a host loop that calls one step many times."""
        compiled = tf.function(fn, autograph=False)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            with self.activations(microbatches):
                return compiled(*args, **kwargs)

        def concrete(*args):
            with self.activations(microbatches):
                return compiled.get_concrete_function(*args)

        run.experimental_get_tracing_count = compiled.experimental_get_tracing_count
        run.concrete = concrete
        return run

    # -- the data layout ------------------------------------------------------

    def batch_axis(self, feature_axes: Sequence[str | None] = ("batch",)) -> str | None:
        """The mesh axis a feature's batch dimension (its first logical axis) is split over."""
        return batch_mesh_axis(feature_axes, self.table, self.mesh)

    def host_rows(self, global_batch: int, feature_axes: Sequence[str | None] = ("batch",)) -> int:
        """Rows of the global batch this host feeds (see the module function `host_rows`)."""
        return host_rows(global_batch, self.mesh, self.batch_axis(feature_axes))

    def host_row_indices(self, global_batch: int, feature_axes: Sequence[str | None] = ("batch",)) -> np.ndarray:
        """Which rows of the global batch this host feeds, in the order it feeds them."""
        axis = self.batch_axis(feature_axes)
        per_shard = global_batch // (self.mesh.dim_size(axis) if axis else 1)
        return np.concatenate([np.arange(i * per_shard, (i + 1) * per_shard) for i in local_shards(self.mesh, axis)])

    def split_microbatches(self, host_batch: Mapping[str, np.ndarray], microbatches: int,
                           feature_axes: Mapping[str, Sequence[str | None]], leading_dims: int = 0
                           ) -> dict[str, np.ndarray]:
        """This host's batch [*leading, rows, ...] as [*leading, microbatches, rows / microbatches, ...],
        each microbatch split over the batch axis like the whole batch (the module function
        `split_microbatches` over the batch shards this host feeds)."""
        axis = self.batch_axis(tuple(feature_axes[next(iter(host_batch))]))
        return split_microbatches(host_batch, microbatches, len(local_shards(self.mesh, axis)), leading_dims)

    def to_global(self, host_batch: Mapping[str, np.ndarray | tf.Tensor],
                  feature_axes: Mapping[str, Sequence[str | None]], leading_dims: int = 0) -> dict[str, tf.Tensor]:
        """Packs this host's rows of every feature into global DTensors.

        Args:
          host_batch: {feature: array [*leading, host_rows, ...]}.
          feature_axes: {feature: logical axes of [batch, ...]}; the first is the batch axis.
          leading_dims: unsharded dimensions before the batch one (e.g. steps of a loop).

        Returns:
          {feature: DTensor with the batch dimension sharded as the rules say}.
        """
        out = {}
        devices = self.mesh.local_device_locations()
        for name, value in host_batch.items():
            axes = tuple(feature_axes[name])
            batch_axis = self.batch_axis(axes)
            layout = layout_for((None,) * leading_dims + axes, self.table, self.mesh)
            shards = local_shards(self.mesh, batch_axis)
            value = self._context_order(tf.convert_to_tensor(value), layout)
            rows = value.shape[leading_dims]
            if rows % len(shards):
                raise UserError(f"feature {name!r}: {rows} host rows do not split over {len(shards)} local batch shards")
            per = rows // len(shards)
            pieces = {}
            components = []
            for loc in devices:
                index = shards.index(loc[batch_axis]) if batch_axis else 0
                if index not in pieces:
                    begin = [0] * value.shape.rank
                    begin[leading_dims] = index * per
                    size = [-1] * value.shape.rank
                    size[leading_dims] = per
                    pieces[index] = tf.slice(value, begin, size)
                components.append(_shard_other_dims(pieces[index], layout, loc, leading_dims))
            out[name] = dtensor.pack(components, layout)
        return out

    def _context_order(self, value: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
        """`value` with each dimension split over the `context` axis in its balanced token
        order (partitioning.context.zigzag)."""
        for dim, spec in enumerate(layout.sharding_specs):
            if spec == CONTEXT_AXIS and self.mesh.dim_size(spec) > 1:
                value = tf.gather(value, zigzag(value.shape[dim], self.mesh.dim_size(spec)), axis=dim)
        return value

    def to_host(self, value: tf.Tensor, feature_axes: Sequence[str | None] = ("batch",)) -> np.ndarray:
        """This host's rows of a DTensor split over the batch only, in the order the host fed them
        (`to_global`'s inverse)."""
        axis = self.batch_axis(feature_axes)
        pieces = {}
        for loc, component in zip(self.mesh.local_device_locations(), dtensor.unpack(value)):
            pieces.setdefault(loc[axis] if axis else 0, component.numpy())
        return np.concatenate([pieces[s] for s in local_shards(self.mesh, axis)])


def _shard_other_dims(piece: tf.Tensor, layout: dtensor.Layout, loc: Mapping[str, int], leading_dims: int) -> tf.Tensor:
    """Slices non-batch dimensions a rule shards too (e.g. length under sequence parallelism)."""
    return device_slice(piece, layout, loc, skip=leading_dims)


def device_slice(value, layout: dtensor.Layout, loc: Mapping[str, int], skip: int | None = None):
    """The piece of a whole value [*shape] that the device at mesh location `loc` holds
    under `layout` (dimension `skip` left whole); a tf.Tensor or numpy array."""
    for dim, spec in enumerate(layout.sharding_specs):
        if dim == skip or spec == dtensor.UNSHARDED:
            continue
        size = value.shape[dim] // layout.mesh.dim_size(spec)
        index = [slice(None)] * len(value.shape)
        index[dim] = slice(loc[spec] * size, (loc[spec] + 1) * size)
        value = value[tuple(index)]
    return value


def place(value: np.ndarray, layout: dtensor.Layout) -> tf.Tensor:
    """A whole host array as a DTensor of `layout`: each of this host's devices gets only
    its own piece (e.g. a checkpoint tensor read once, put straight into its layout)."""
    components = [tf.convert_to_tensor(device_slice(value, layout, loc))
                  for loc in layout.mesh.local_device_locations()]
    return dtensor.pack(components, layout)
