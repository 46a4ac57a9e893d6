"""One host's record pipeline: the skeleton every task's input plugs its parsing into.

    this host's files (common.host_shard)
      -> read: files shuffled each epoch (seeded) and repeated when training, read a few
         at a time (a deterministic interleave of TFRecords, or whole files as
         documents); with fewer files than hosts every host keeps every H-th record
      -> the task's parse and transforms, with `shuffled` where the task shuffles and
         `host_share` where it caps its eval examples
      -> batched: host batches (training: full ones only), deterministic, prefetched

Every stage keeps element order for a seed, and nothing runs in Python, so a host's
iterator is checkpointable (the trainer saves its position with each checkpoint).
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tfpod.input.common import ShardInfo
from tfpod.input.files import HostShard

AUTOTUNE = tf.data.AUTOTUNE


def read(plan: HostShard, seed: int, repeat: bool, cycle_length: int, skip_corrupt: bool = False,
         whole_files: bool = False, with_paths: bool = False) -> tf.data.Dataset:
    """The records (or, with `whole_files`, each file's bytes) of this host's files.

    Args:
      plan: this host's files (common.host_shard).
      seed: the file order's shuffle (the same on every host).
      repeat: shuffle the files each epoch and repeat forever (training).
      cycle_length: files read at once.
      skip_corrupt: skip unreadable TFRecord data (TensorFlow logs each skip).
      whole_files: each file is one element (text documents) instead of its records.
      with_paths: each element is (its file's path, the record), to name the file in checks.
    """
    ds = tf.data.Dataset.from_tensor_slices(list(plan.files))
    if repeat:
        ds = ds.shuffle(len(plan.files), seed=seed, reshuffle_each_iteration=True).repeat()
    if whole_files:
        ds = ds.map(tf.io.read_file, num_parallel_calls=AUTOTUNE, deterministic=True)
    else:
        def records(path):
            ds = tf.data.TFRecordDataset(path)
            ds = ds.apply(tf.data.experimental.ignore_errors(log_warning=True)) if skip_corrupt else ds
            return ds.map(lambda record: (path, record)) if with_paths else ds

        ds = ds.interleave(records, cycle_length=cycle_length, num_parallel_calls=AUTOTUNE, deterministic=True)
    if plan.record_shard:
        ds = ds.shard(plan.num_hosts, plan.host_id)
    return ds


def shuffled(ds: tf.data.Dataset, buffer: int, seed: int) -> tf.data.Dataset:
    """Elements shuffled through a buffer of `buffer` (0: not shuffled), seeded by seed + 1."""
    return ds.shuffle(buffer, seed=seed + 1) if buffer else ds


def host_share(ds: tf.data.Dataset, max_examples: int | None, shard: ShardInfo) -> tf.data.Dataset:
    """This host's share of at most `max_examples` examples over all hosts (None: all)."""
    if max_examples is None:
        return ds
    base, extra = divmod(max_examples, shard.num_shards)
    return ds.take(base + (1 if shard.index < extra else 0))


def batched(ds: tf.data.Dataset, host_rows: int, repeat: bool,
            distribute: Callable[[tf.data.Dataset], tf.data.Dataset] | None = None) -> tf.data.Dataset:
    """Host batches of `host_rows` (training drops a partial last batch: DTensor needs static
    shapes; evaluation keeps it, padded later), deterministic, prefetched; `distribute` (the
    tf.data service) applies before the prefetch."""
    ds = ds.batch(host_rows, drop_remainder=repeat)
    options = tf.data.Options()
    options.deterministic = True
    ds = ds.with_options(options)
    if distribute is not None:
        ds = distribute(ds)
    return ds.prefetch(AUTOTUNE)
