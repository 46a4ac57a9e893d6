"""The doctor's checks of what a run reads and writes: the model_dir (writable, its write
speed, free space for the checkpoints the planner predicts) and this host's input files.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import tensorflow as tf

from tfpod import UserError
from tfpod.doctor.result import Result
from tfpod.partitioning.report import human_bytes

_CHUNK = 1 << 20  # bytes written per call by the write-speed probe
_HEAD = 4096  # bytes read from the start of each input file
FAST_INPUT_FILES = 256  # input files the fast preflight reads the start of (the doctor: all of this host's)


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _tree_bytes(folder: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def missing_folders(path: str) -> list[str]:
    """The folders of `path` (itself included) that do not exist yet, deepest first."""
    created, path = [], os.path.abspath(path)
    while not os.path.exists(path):
        created.append(path)
        path = os.path.dirname(path)
    return created


def remove_empty(folders: list[str]) -> None:
    """Removes these folders (deepest first, as `missing_folders` lists them) while they are
    empty: a folder something else filled meanwhile stays, and so do those above it."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            break


def probe_write(model_dir: str, size: int, host_id: int, keep_folders: bool = False) -> float:
    """Writes `size` bytes (at least one) to a scratch file in model_dir, fsyncs and removes it;
    folders it had to create are removed again unless `keep_folders` (the preflight: the run
    creates model_dir anyway, and with several hosts one host's removal could pull the
    folder from under another host's own write check). Returns the seconds the write and
    fsync took.

    Raises:
      OSError: model_dir cannot be created or written.
    """
    created = missing_folders(model_dir)
    probe = os.path.join(model_dir, f".tfpod-doctor-{host_id}-{os.getpid()}")
    try:
        os.makedirs(model_dir, exist_ok=True)
        block = os.urandom(min(max(size, 1), _CHUNK))
        start = time.perf_counter()
        with open(probe, "wb") as f:
            left = max(size, 1)
            while left > 0:
                left -= f.write(block[:left])
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - start
    finally:
        if os.path.exists(probe):
            os.remove(probe)
        if not keep_folders:
            remove_empty(created)


def model_dir_checks(model_dir: str, checkpoint: tuple[int, int] | str, keep: int, write_bytes: int,
                     host_id: int, keep_folders: bool = False) -> list[Result]:
    """model_dir writable (and its write speed), and free space for keep + 1 checkpoints.

    Args:
      model_dir: --model_dir.
      checkpoint: (bytes of one checkpoint, parameters) as the planner predicts them, or
        why it could not (a message).
      keep: train.keep_checkpoints: a run keeps these and writes one more before it
        deletes the oldest.
      write_bytes: bytes the write-speed probe writes (a few bytes: writability only).
      host_id: this host (names the scratch file: hosts may share model_dir).
      keep_folders: leave the folders the write probe created (probe_write).
    """
    try:
        seconds = probe_write(model_dir, write_bytes, host_id, keep_folders)
    except OSError as e:
        return [Result("FAIL", "model_dir", f"--model_dir={model_dir} cannot be written ({e.strerror or e})",
                       "pass a folder this process may create and write, e.g. on a local or mounted disk")]
    speed = write_bytes / seconds if write_bytes > _CHUNK and seconds > 0 else None
    found = f"{model_dir} is writable"
    if speed:
        found += f"; wrote and synced {human_bytes(write_bytes)} at {speed / 1e6:.0f} MB/s"
    results = [Result("ok", "model_dir", found)]
    if isinstance(checkpoint, str):
        results.append(Result("FAIL", "free space", f"the checkpoint size cannot be predicted ({checkpoint})",
                              "fix the config: python main.py --mode=plan names the same error"))
        return results
    size, parameters = checkpoint
    free = shutil.disk_usage(_existing_parent(model_dir)).free
    held = _tree_bytes(os.path.join(model_dir, "checkpoints")) if os.path.isdir(model_dir) else 0
    need = max(0, (keep + 1) * size - held)
    what = (f"{keep + 1} checkpoints of {human_bytes(size)} ({parameters:,} parameters; train.keep_checkpoints="
            f"{keep} kept + 1 being written{f', less the {human_bytes(held)} already there' if held else ''})")
    if free < need:
        results.append(Result("FAIL", "free space", f"{human_bytes(free)} free under {model_dir}, but {what} need "
                                                    f"{human_bytes(need)}",
                              "free space there, pass a --model_dir on a larger disk, or lower "
                              "train.keep_checkpoints"))
        return results
    found = f"{human_bytes(free)} free holds {what}"
    if speed:
        found += f"; a checkpoint write takes about {size / speed:.2g} s at {speed / 1e6:.0f} MB/s"
    results.append(Result("ok", "free space", found))
    return results


def _read_head(path: str) -> str | None:
    """Why the start of `path` cannot be read (None: it can)."""
    try:
        if tf.io.gfile.isdir(path):
            return "a folder, not a file"
        with tf.io.gfile.GFile(path, "rb") as f:
            if not f.read(_HEAD):
                return "empty"
    except (tf.errors.OpError, OSError) as e:
        text = getattr(e, "message", None) or str(e) or type(e).__name__
        return text.replace(f"{path}; ", "")  # TensorFlow's messages lead with the path
    return None


def input_checks(configs, mode: str, num_hosts: int, host_id: int, max_files: int | None = None) -> list[Result]:
    """This host's input files of every `*_files` pattern of the data config (the files
    `tfpod.input.files.plan` gives this host, as the run reads them) and every `*_path`
    file: each matches, and the start of each can be read.

    Args:
      configs: api.RunConfigs.
      mode: --mode (eval reads no training files).
      num_hosts, host_id: this host of the job.
      max_files: read the start of at most this many files per pattern (None: all).
    """
    from tfpod.input import demo, files as files_lib

    name = configs.task.data_name
    if configs.train.synthetic_data and mode != "eval":
        return [Result("ok", "input", "synthetic data (train.synthetic_data=True): no files read")]
    results = []
    for field in dataclasses.fields(configs.data):
        value = getattr(configs.data, field.name)
        check = f"input {name}.{field.name}"
        if field.name.endswith("_files"):
            if field.name.startswith("train") and mode == "eval":
                continue
            if value is None:
                if field.name == "train_files":
                    where = configs.data.data_dir or demo.data_root()
                    results.append(Result("ok", check, f"unset: the demo data, prepared on first use under {where}"))
                continue
            try:
                shard = files_lib.plan(value, num_hosts, host_id, configs.train.seed)
            except UserError as e:
                results.append(Result("FAIL", check, str(e)))
                continue
            paths = shard.files if max_files is None else shard.files[:max_files]
            bad = [(p, why) for p in paths if (why := _read_head(p)) is not None]
            if bad:
                named = "; ".join(f"{p}: {' '.join(why.split())}" for p, why in bad[:3])
                more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
                results.append(Result("FAIL", check, f"{len(bad)} of this host's {len(shard.files)} input file(s) "
                                                     f"cannot be read: {named}{more}",
                                      "remove them from the pattern, or restore the files"))
                continue
            read = "" if len(paths) == len(shard.files) else f" (the first {len(paths)})"
            results.append(Result("ok", check, f"host {host_id} of {num_hosts} reads {len(shard.files)} file(s) of "
                                               f"{value!r}; the start of each{read} reads"))
        elif field.name.endswith("_path") and isinstance(value, str):
            why = _read_head(value) if tf.io.gfile.exists(value) else "no such file"
            if why:
                results.append(Result("FAIL", check, f"{value} cannot be read: {why}",
                                      f"set {name}.{field.name} to a readable file"))
            else:
                results.append(Result("ok", check, f"{value} reads"))
    return results or [Result("ok", "input", f"no input files set in {name}")]
