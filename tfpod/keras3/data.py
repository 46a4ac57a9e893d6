"""Batches onto the mesh: what Keras 3's data adapters yield -> batch-sharded DTensors.

Keras reads a `tf.data.Dataset`, NumPy arrays, a generator or a PyDataset through its
own data adapters (shuffling, batching, and with several hosts `distribution.distribute_dataset`:
each host keeps its rows of every global batch). `MeshBatches` iterates that dataset
once, on the host, in Keras's own order, and packs every batch into DTensors laid out as
`distribution.get_data_layout(shape)` says (the batch dimension over the batch axis),
each local device getting only its rows. One host-side iterator means a dataset shuffled
without a seed still gives every device rows of the same batch.

On several hosts Keras's `distribute_dataset` re-batches and shards the dataset, which loses
its length; a dataset of whole batches (a static batch dimension) keeps it here, so that Keras
knows each epoch's steps (without it Keras warns that the input "ran out of data" at the end of
the first epoch).

A batch whose rows do not divide over the batch axis (the last, partial batch of arrays
whose length is not a multiple of the batch size) runs replicated on one host: every
device computes all its rows, which is what one device computes. On several hosts every
host must feed whole batches (`drop_remainder=True`).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.keras3 import backend, internals, placement

log = logging.getLogger("tfpod")


class BatchPlacer:
    """Places host batches (nests of tensors or arrays) on a distribution's mesh.

    Args:
      distribution: the keras.distribution the model was built under.
    """

    def __init__(self, distribution):
        self.distribution = distribution
        self.mesh = distribution.device_mesh.backend_mesh
        self._warned = False

    def layout(self, shape) -> dtensor.Layout:
        if len(shape) == 0:
            return dtensor.Layout.replicated(self.mesh, 0)
        return backend.backend_layout(self.distribution.get_data_layout(shape))

    def _batch_rows(self, leaves) -> int | None:
        sizes = {int(x.shape[0]) for x in leaves if x.ndim > 0}
        if len(sizes) > 1:
            raise UserError(f"the inputs of one batch have different numbers of rows {sorted(sizes)}: every feature, "
                            "target and sample weight needs the batch as its first dimension")
        return sizes.pop() if sizes else None

    def place(self, batch):
        """A batch (x, (x, y) or (x, y, sample_weight), nests allowed) as DTensors on the mesh."""
        flat = tf.nest.flatten(batch)
        leaves = [None if x is None else self._host(x) for x in flat]
        rows = self._batch_rows([x for x in leaves if x is not None])
        replicated = rows is not None and self._partial(rows)
        placed = []
        for x in leaves:
            if x is None:
                placed.append(None)
            elif replicated or x.ndim == 0:
                placed.append(placement.place(x, dtensor.Layout.replicated(self.mesh, x.ndim)))
            else:
                placed.append(placement.place_rows(x, self.layout(x.shape)))
        return tf.nest.pack_sequence_as(batch, placed)

    def _host(self, x) -> np.ndarray:
        if isinstance(x, (tf.SparseTensor, tf.RaggedTensor)):
            raise UserError(f"a {type(x).__name__} input under keras.distribution on TensorFlow: DTensor lays out "
                            "dense tensors only; pad it to a dense tensor in the input pipeline (x.to_tensor())")
        if isinstance(x, tf.Tensor) and dtensor.is_dtensor(x):
            raise UserError("a batch that is already a DTensor (tfpod.input.to_mesh serves tf_keras): give Keras 3 "
                            "the plain tf.data.Dataset or arrays; the distribution splits them over the batch axis")
        return np.asarray(x)

    def _partial(self, rows: int) -> bool:
        """Whether a batch of `rows` rows must run replicated (it does not split over the batch shards)."""
        layout = self.layout((rows,))
        axis, shards = placement.local_shards(layout)
        if axis is None or rows % len(shards) == 0:
            return False
        if self.mesh.num_local_devices() != self.mesh.size:
            raise UserError(f"a batch of {rows} rows on this host does not split over the {len(shards)} shards of "
                            f"mesh axis {axis!r} its devices hold; with several hosts every batch must be whole: "
                            "batch the dataset with drop_remainder=True")
        if not self._warned:
            log.warning("keras.distribution: a batch of %d rows does not split over the %d shards of mesh axis %r: "
                        "it runs replicated (every device computes all %d rows, as one device would)",
                        rows, len(shards), axis, rows)
            self._warned = True
        return True


class MeshBatches:
    """An iterable over a dataset's batches placed on the mesh (a new pass per `iter`).

    Args:
      dataset: what Keras's data adapter made (a tf.data.Dataset of host batches).
      placer: the BatchPlacer of the model's distribution.
    """

    def __init__(self, dataset: tf.data.Dataset, placer: BatchPlacer):
        self.dataset = dataset
        self.placer = placer

    def __iter__(self):
        for batch in self.dataset:
            yield self.placer.place(batch)


def _keeping_length(original):
    @functools.wraps(original)
    def distribute_dataset(self, dataset):
        distributed = original(self, dataset)
        if distributed is dataset or not isinstance(dataset, tf.data.Dataset):
            return distributed
        count = int(dataset.cardinality().numpy())
        whole = all(s.shape.rank and s.shape[0] is not None for s in tf.nest.flatten(dataset.element_spec))
        if count >= 0 and whole and int(distributed.cardinality().numpy()) < 0:
            distributed = distributed.apply(tf.data.experimental.assert_cardinality(count))
        return distributed

    return distribute_dataset


_ORIGINAL = {}


def install() -> None:
    """Wraps Keras's Distribution.distribute_dataset (once)."""
    if _ORIGINAL:
        return
    base = internals.distribution_base_class()
    _ORIGINAL["distribute_dataset"] = base.distribute_dataset
    base.distribute_dataset = _keeping_length(base.distribute_dataset)
