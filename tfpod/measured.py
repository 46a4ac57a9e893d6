"""Figures measured on this machine, kept between runs: a CPU's matmul peak, its memory bandwidth.

A CPU has no data sheet, so tfpod measures it: the matmul peak every training run logs MFU
against (about a second), and the peaks and memory bandwidth `--mesh=auto` and
`--mode=plan --plan_device=cpu` predict with (about ten seconds). The first run on a
machine measures them; later runs read them from `measured.json` in the cache folder:
`$TFPOD_CACHE_DIR`, else `$XDG_CACHE_HOME/tfpod`, else `~/.cache/tfpod`.

A figure is keyed by everything it depends on: the CPU (model, cores, AVX-512), the kernel
path (oneDNN or Eigen), TensorFlow's version, the intra-op threads of one op, and the
measurement's own settings. Delete the file (or one entry) to measure again, for example
after a first run on a busy machine; `TFPOD_CACHE_DIR=off` measures in every run. A cache
that cannot be read or written is measured around, with one warning.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Callable

log = logging.getLogger("tfpod")

FILE = "measured.json"


def cache_dir() -> str | None:
    """The cache folder, or None when TFPOD_CACHE_DIR=off."""
    explicit = os.environ.get("TFPOD_CACHE_DIR")
    if explicit:
        return None if explicit.lower() == "off" else explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tfpod")


def machine_key() -> str:
    """What a CPU figure depends on: the CPU line (model, cores, AVX-512, kernel path,
    TensorFlow) and the intra-op threads one op gets."""
    import tensorflow as tf

    from tfpod import runtime

    threads = tf.config.threading.get_intra_op_parallelism_threads()
    return f"{runtime.describe_cpu()}; intra-op threads {threads or 'default'}"


def _read(path: str, warn: bool = True) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
        return table if isinstance(table, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        if warn:
            log.warning("measured figures: %s cannot be read (%s): measuring again and rewriting it", path, e)
        return {}


def figure(name: str, measure: Callable[[], float], key: str | None = None) -> float:
    """`name`'s value on this machine: read from the cache, or `measure()`d and kept.

    Args:
      name: what is measured, with its settings (e.g. "matmul float32 n=2048").
      measure: () -> the figure.
      key: what else it depends on (default: `machine_key()`).
    """
    folder = cache_dir()
    if folder is None:
        return measure()
    entry = f"{name} | {key or machine_key()}"
    path = os.path.join(folder, FILE)
    value = _read(path).get(entry)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    value = measure()
    try:
        os.makedirs(folder, exist_ok=True)
        table = _read(path, warn=False)  # again: another process may have added figures meanwhile
        table[entry] = value
        fd, tmp = tempfile.mkstemp(prefix=".measured-", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
            os.replace(tmp, path)  # whole or not at all, whoever writes last
        finally:
            if os.path.exists(tmp):  # a write that failed (a full disk) leaves no temp file behind
                os.remove(tmp)
    except OSError as e:
        log.warning("measured figures: cannot keep them in %s (%s): every run measures again "
                    "(set TFPOD_CACHE_DIR to a writable folder, or TFPOD_CACHE_DIR=off)", folder, e)
    return value
