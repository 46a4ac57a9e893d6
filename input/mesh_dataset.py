"""`to_mesh`: a tf.data.Dataset of global batches -> batch-sharded DTensors for Keras.

Each local device reads its own rows through its own iterator over the dataset; the
iterators are packed into one DTensor iterator, as `dtensor.DTensorDataset` does.
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, compat
from tfpod.partitioning import host_rows, local_shards

log = logging.getLogger("tfpod")

def _dtensor_iterator_class():
    class _MeshIterator(compat.dtensor_iterator_base()):
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


class MeshDataset(compat.unary_dataset_base()):
    """A dataset whose iterator yields batch-sharded DTensors over a mesh (see `to_mesh`).

    To Keras it is an ordinary dataset (not a "distributed" one): fit makes a new
    iterator every epoch and takes the number of steps from `cardinality()`, which
    is always known (or infinite).
    """

    def __init__(self, host_batches: tf.data.Dataset, mesh: dtensor.Mesh, layouts, global_spec,
                 device_datasets: list):
        super().__init__(host_batches, compat.variant_tensor(host_batches))
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
        host_mesh = self._mesh.host_mesh()
        resources = []
        for device, dataset in zip(host_mesh.local_devices(), self._device_datasets):
            with tf.device(device):
                resources.append(compat.iterator_resource(iter(dataset)))
        # The per-device iterators, packed as one DTensor resource (as DTensorDataset does).
        packed = compat.pack_resources(resources, dtensor.Layout.replicated(host_mesh, rank=0))
        host_layouts = tf.nest.map_structure(lambda l: dtensor.Layout(l.sharding_specs, host_mesh), self._layouts)
        compat.set_iterator_element_layouts(packed, tf.nest.flatten(host_layouts))
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
    flat_specs = _check(dataset, mesh, batch_axis)
    static = _batch_size_of(flat_specs)
    if global_batch_size is None:
        if per_host:
            raise UserError("to_mesh(per_host=True) needs global_batch_size (the rows of all hosts' batches together)")
        global_batch_size = static if static is not None else _first_batch_size(dataset)
    rows = host_rows(global_batch_size, mesh, batch_axis)
    expected = rows if per_host else global_batch_size
    if static is not None and static != expected:
        raise UserError(
            f"to_mesh: the dataset's batches have {static} rows but "
            f"{'this host needs' if per_host else 'the global batch has'} {expected}: batch it with {expected}"
        )
    host_batches = _full_batches(dataset, expected, static is None, num_batches)
    elem_spec = host_batches.element_spec
    layouts = tf.nest.map_structure(
        lambda s: dtensor.Layout([batch_axis or dtensor.UNSHARDED] + [dtensor.UNSHARDED] * (s.shape.rank - 1), mesh),
        elem_spec,
    )
    global_spec = tf.nest.map_structure(
        lambda s: tf.TensorSpec([global_batch_size] + s.shape.as_list()[1:], s.dtype, s.name), elem_spec
    )
    devices = _device_datasets(host_batches, mesh, batch_axis, global_batch_size, per_host, prefetch)
    return MeshDataset(host_batches, mesh, layouts, global_spec, devices)


def _check(dataset, mesh: dtensor.Mesh, batch_axis: str | None) -> list:
    """to_mesh's argument checks; returns the flat element specs."""
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
    return flat_specs


def _first_batch_size(dataset: tf.data.Dataset) -> int:
    """The rows of the dataset's first batch (read once)."""
    first = next(iter(dataset.take(1)), None)
    if first is None:
        raise UserError("to_mesh: the dataset is empty")
    return int(tf.nest.flatten(first)[0].shape[0])


def _full_batches(dataset: tf.data.Dataset, rows: int, dynamic: bool, num_batches: int | None) -> tf.data.Dataset:
    """The dataset's batches of `rows` rows with that static shape (with `dynamic` batch shapes a
    partial last batch is dropped), and a known count (`num_batches`, else counted once)."""
    host_batches = dataset
    if dynamic:
        # Only full batches have the static shape a DTensor needs; a partial last batch is dropped.
        host_batches = host_batches.filter(lambda *e: tf.equal(tf.shape(tf.nest.flatten(e)[0])[0], rows))
        host_batches = host_batches.map(lambda *e: tf.nest.map_structure(
            lambda t: tf.ensure_shape(t, [rows] + t.shape.as_list()[1:]), _element(e)))
    if int(host_batches.cardinality().numpy()) == tf.data.UNKNOWN_CARDINALITY:
        if num_batches is None:
            num_batches = int(host_batches.reduce(np.int64(0), lambda n, _: n + 1).numpy())
            log.info("to_mesh: counted %d full batches of %d rows (one pass over the dataset; pass "
                     "num_batches= to skip it)", num_batches, rows)
        host_batches = host_batches.apply(tf.data.experimental.assert_cardinality(num_batches))
    if int(host_batches.cardinality().numpy()) == 0:
        raise UserError(f"to_mesh: the dataset has no full batch of {rows} rows")
    return host_batches


def _device_datasets(host_batches: tf.data.Dataset, mesh: dtensor.Mesh, batch_axis: str | None,
                     global_batch_size: int, per_host: bool, prefetch: int) -> list:
    """Each local device's dataset: its rows of every batch (the batch shard it holds)."""
    shards = mesh.dim_size(batch_axis) if batch_axis else 1
    local = local_shards(mesh, batch_axis)
    per_shard = global_batch_size // shards

    def rows_from(begin):
        return lambda *e: tf.nest.map_structure(lambda t: t[begin:begin + per_shard], _element(e))

    device_datasets = []
    for loc in mesh.local_device_locations():
        ds = host_batches
        if batch_axis is not None:
            shard = loc[batch_axis]
            ds = ds.map(rows_from((local.index(shard) if per_host else shard) * per_shard))
        device_datasets.append(ds.prefetch(prefetch) if prefetch else ds)
    return device_datasets
