"""The MLPerf DLRM-dcnv2 reference's preprocessed Criteo 1TB multi-hot files, read per host.

The reference (mlcommons/training recommendation_v2/torchrec_dlrm: data/dlrm_dataloader.py,
data/multi_hot_criteo.py, scripts/materialize_synthetic_multihot_dataset.py) keeps each
day d of the click logs as three files in one folder:

  day_<d>_dense.npy              float32 [rows, 13]  the 13 integer features, as its preprocessing wrote them
  day_<d>_labels.npy             int32 [rows, 1]     click (1) or not (0)
  day_<d>_sparse_multi_hot.npz   an uncompressed np.savez of "0".."25": int32 [rows, hot_t]
                                 (ids already hashed to each table's size)

and trains on days 0-22 and evaluates on day 23: its first half (rows [0, ceil(n/2)))
is the validation set, the second the test set. Here `click_data.train_files` names the
dense files (the other two are found beside each), `click_data.eval_files` the eval
day's, `click_data.eval_split` the half.

Reading is native tf.data: every .npy array (also inside the .npz, whose entries are
stored) is fixed-length records after a header, so each array is a
FixedLengthRecordDataset whose header and footer skip to exactly the rows wanted; a
host's rows are a contiguous share of the split's rows in file order (every example
read by one host once), so each host opens only its own files. Batches decode with
tf.io.decode_raw. The iterator holds no Python state, so its position is checkpointed
with the model (tfpod.input_position) and a resumed run continues at the next row.

`write_day` writes a day in the same format (tests; a small demo).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import struct
import zipfile
from typing import Sequence

import numpy as np
import tensorflow as tf

from tfpod import UserError
from tfpod.input.common import ShardInfo, TaskInput

DENSE_SUFFIX = "_dense.npy"
FORMAT_FIX = "write the files as the reference's preprocessing does (tfpod.input.criteo.write_day)"


@dataclasses.dataclass(frozen=True)
class Array:
    """One stored .npy array: its file, where its data starts, its shape and dtype."""

    path: str
    offset: int
    shape: tuple
    dtype: np.dtype

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def records(self, start: int, stop: int) -> tf.data.Dataset:
        """Its rows [start, stop) as raw fixed-length records."""
        size = os.path.getsize(self.path)
        header = self.offset + start * self.row_bytes
        footer = size - self.offset - stop * self.row_bytes
        return tf.data.FixedLengthRecordDataset(self.path, self.row_bytes, header_bytes=header, footer_bytes=footer)


def _npy_header(f, path: str, label: str | None = None) -> Array:
    """The .npy header at f's position: the array's data starts where the header ends."""
    label = label or path
    try:
        version = np.lib.format.read_magic(f)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = reader(f)
    except ValueError as e:
        raise UserError(f"{label}: not a .npy array ({e}): {FORMAT_FIX}") from None
    if fortran:
        raise UserError(f"{label}: a Fortran-ordered array; {FORMAT_FIX}")
    return Array(path, f.tell(), tuple(shape), np.dtype(dtype))


def read_npy(path: str) -> Array:
    """The header of a .npy file."""
    with open(path, "rb") as f:
        return _npy_header(f, path)


def read_npz(path: str) -> dict[str, Array]:
    """The headers of the arrays inside an uncompressed .npz (np.savez), by name."""
    out = {}
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    with open(path, "rb") as f:
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise UserError(f"{path}: entry {info.filename} is compressed (np.savez_compressed); the reference "
                                f"writes np.savez: {FORMAT_FIX}")
            f.seek(info.header_offset)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            f.seek(start)
            array = _npy_header(f, path, f"{path}:{info.filename}")
            out[info.filename[:-4] if info.filename.endswith(".npy") else info.filename] = array
    return out


@dataclasses.dataclass(frozen=True)
class Day:
    """One day's three files' arrays: dense, labels, and the multi-hot ids of each table."""

    dense: Array
    labels: Array
    sparse: tuple

    @property
    def rows(self) -> int:
        return self.dense.shape[0]


def open_day(dense_path: str, tables: int) -> Day:
    """A day from its dense file's path (labels and multi-hot ids found beside it), checked."""
    if not dense_path.endswith(DENSE_SUFFIX):
        raise UserError(f"click_data files: {dense_path} is not a day_<d>{DENSE_SUFFIX} file")
    stem = dense_path[: -len(DENSE_SUFFIX)]
    labels_path, sparse_path = stem + "_labels.npy", stem + "_sparse_multi_hot.npz"
    for p in (labels_path, sparse_path):
        if not os.path.exists(p):
            raise UserError(f"click_data files: {p} is missing beside {dense_path}: {FORMAT_FIX}")
    dense, labels, sparse = read_npy(dense_path), read_npy(labels_path), read_npz(sparse_path)
    missing = [str(t) for t in range(tables) if str(t) not in sparse]
    if missing:
        raise UserError(f"{sparse_path} has no arrays {', '.join(missing[:4])} (the model has {tables} tables): "
                        f"{FORMAT_FIX}, or set dlrm.table_sizes")
    day = Day(dense, labels, tuple(sparse[str(t)] for t in range(tables)))
    for a in (labels, *day.sparse):
        if a.shape[0] != dense.shape[0]:
            raise UserError(f"{a.path} has {a.shape[0]} rows but {dense.path} {dense.shape[0]}: {FORMAT_FIX}")
    if dense.dtype != np.float32 or any(a.dtype != np.int32 for a in day.sparse):
        raise UserError(f"{dense.path}: dense must be float32 and ids int32 (found {dense.dtype}, "
                        f"{sorted({str(a.dtype) for a in day.sparse})}): {FORMAT_FIX}")
    return day


def files(patterns: str) -> list[str]:
    """The dense files of comma-separated globs, sorted by day number."""
    found = []
    for pattern in patterns.split(","):
        matched = glob.glob(pattern.strip())
        if not matched:
            raise UserError(f"click_data files: {pattern.strip()!r} matches no file")
        found.extend(matched)

    def day_number(path):
        name = os.path.basename(path)[len("day_"): -len(DENSE_SUFFIX)]
        return (int(name), path) if name.isdigit() else (1 << 30, path)

    return sorted(set(found), key=day_number)


def host_ranges(days: Sequence[Day], row_ranges: Sequence[tuple], shard: ShardInfo) -> list[tuple]:
    """This host's (day, start, stop) pieces: a contiguous, even share of the rows, in file order."""
    total = sum(b - a for a, b in row_ranges)
    base, extra = divmod(total, shard.num_shards)
    begin = shard.index * base + min(shard.index, extra)
    end = begin + base + (1 if shard.index < extra else 0)
    out, offset = [], 0
    for day, (a, b) in zip(days, row_ranges):
        lo, hi = max(begin, offset), min(end, offset + b - a)
        if lo < hi:
            out.append((day, a + lo - offset, a + hi - offset))
        offset += b - a
    return out


def _dataset(pieces, model_config) -> tf.data.Dataset:
    parts = []
    for day, start, stop in pieces:
        arrays = [day.dense, day.labels, *day.sparse]
        parts.append(tf.data.Dataset.zip(tuple(a.records(start, stop) for a in arrays)))
    ds = parts[0]
    for p in parts[1:]:
        ds = ds.concatenate(p)
    return ds


def _decoder(model_config):
    sizes = list(model_config.table_sizes)

    def decode(*records):
        dense = tf.io.decode_raw(records[0], tf.float32)  # [rows, dense_features]
        out = {"dense": tf.reshape(dense, [-1, model_config.dense_features]),
               "labels": tf.cast(tf.reshape(tf.io.decode_raw(records[1], tf.int32), [-1]), tf.float32)}
        out["weights"] = tf.ones_like(out["labels"])
        for t, (raw, hot) in enumerate(zip(records[2:], model_config.multi_hot_sizes)):
            ids = tf.reshape(tf.io.decode_raw(raw, tf.int32), [-1, hot])
            out[f"cat_{t}"] = tf.where(ids < 0, ids, ids % sizes[t])  # the reference's hash to the table's size
        return out

    return decode


def _check_shapes(day: Day, model_config) -> None:
    if day.dense.shape[1:] != (model_config.dense_features,):
        raise UserError(f"{day.dense.path} has {day.dense.shape[1:]} dense features per row, the model "
                        f"{model_config.dense_features}: set dlrm.dense_features")
    hot = tuple(a.shape[1] if len(a.shape) > 1 else 1 for a in day.sparse)
    if hot != tuple(model_config.multi_hot_sizes):
        raise UserError(f"{day.sparse[0].path}: multi-hot sizes {hot} differ from dlrm.multi_hot_sizes="
                        f"{tuple(model_config.multi_hot_sizes)}: set dlrm.multi_hot_sizes to the files'")


def split_rows(day: Day, split: str) -> tuple:
    """The rows of the eval day in a split: the reference's first half (val), second (test), or all."""
    half = day.rows // 2 + day.rows % 2
    return {"val": (0, half), "test": (half, day.rows), "all": (0, day.rows)}[split]


def criteo_input(cfg, model_config, shard: ShardInfo, seed: int) -> TaskInput:
    """The reference's Criteo multi-hot files as this host's TaskInput."""
    tables = len(model_config.table_sizes)
    train_days = [open_day(p, tables) for p in files(cfg.train_files)]
    for day in train_days:
        _check_shapes(day, model_config)
    train_pieces = host_ranges(train_days, [(0, d.rows) for d in train_days], shard)
    decode = _decoder(model_config)

    def train(host_rows: int) -> tf.data.Dataset:
        ds = _dataset(train_pieces, model_config).repeat()
        if cfg.shuffle_buffer:
            ds = ds.shuffle(cfg.shuffle_buffer, seed=seed + shard.index)
        ds = ds.batch(host_rows, drop_remainder=True).map(decode, num_parallel_calls=tf.data.AUTOTUNE)
        options = tf.data.Options()
        options.deterministic = True
        return ds.with_options(options).prefetch(tf.data.AUTOTUNE)

    evaluation = None
    if cfg.eval_files:
        eval_days = [open_day(p, tables) for p in files(cfg.eval_files)]
        for day in eval_days:
            _check_shapes(day, model_config)
        ranges = [split_rows(d, cfg.eval_split) for d in eval_days]
        if cfg.max_eval_examples:
            left, capped = cfg.max_eval_examples, []
            for a, b in ranges:
                capped.append((a, a + max(0, min(b - a, left))))
                left -= capped[-1][1] - a
            ranges = capped
        eval_pieces = host_ranges(eval_days, ranges, shard)

        def evaluation(host_rows: int) -> tf.data.Dataset:
            if not eval_pieces:
                return tf.data.Dataset.from_tensors(0).take(0)
            return _dataset(eval_pieces, model_config).batch(host_rows).map(decode).prefetch(2)

    source = {f"click_data.{f.name}": getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if "eval" not in f.name and f.name != "data_dir"}
    source["pieces"] = [[d.dense.path, os.path.getsize(d.dense.path), a, b] for d, a, b in train_pieces]
    source["multi_hot_sizes"] = list(model_config.multi_hot_sizes)
    return TaskInput(train=train, eval=evaluation, find_corrupt=lambda: None, source=source)


def write_day(folder: str, day: int, dense: np.ndarray, labels: np.ndarray, sparse: Sequence[np.ndarray]) -> str:
    """Writes one day in the reference's format (np.save, and np.savez of "0".."25"); returns the dense path."""
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, f"day_{day}")
    np.save(stem + DENSE_SUFFIX, np.asarray(dense, np.float32))
    np.save(stem + "_labels.npy", np.asarray(labels, np.int32).reshape(-1, 1))
    np.savez(stem + "_sparse_multi_hot.npz", **{str(t): np.asarray(ids, np.int32) for t, ids in enumerate(sparse)})
    return stem + DENSE_SUFFIX
