"""Per-host file splitting: host h of H reads only its own files.

The matched file list is sorted, shuffled with a seed that is the same on every host,
and cut into H contiguous parts whose sizes differ by at most one. The parts are a
partition: complete (every file is read by some host), disjoint (by exactly one) and
deterministic (the same on every host and every run). With fewer files than hosts,
every host reads every file and keeps every H-th record (`record_shard`), which
`plan` reports with a logged warning.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Sequence

import tensorflow as tf

from tfpod import UserError

log = logging.getLogger("tfpod")


def expand(patterns: str | Sequence[str]) -> list[str]:
    """Sorted files matching one or more glob patterns (comma-separated or a list).

    Raises:
      UserError: a pattern matches nothing.
    """
    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p.strip()]
    if not patterns:
        raise UserError("no input files given: set the data pattern in gin (e.g. lm_data.train_files)")
    files = []
    for p in patterns:
        matched = tf.io.gfile.glob(p.strip())
        if not matched:
            raise UserError(f"input pattern {p.strip()!r} matches no file: check the path, or run python -m tfpod.input.prepare")
        files.extend(matched)
    return sorted(set(files))


def _check_hosts(num_hosts: int, host_id: int) -> None:
    if num_hosts < 1 or not 0 <= host_id < num_hosts:
        raise UserError(f"host_id={host_id} is not in [0, num_hosts={num_hosts})")


def host_files(pattern: str | Sequence[str], num_hosts: int, host_id: int, seed: int = 0) -> list[str]:
    """The files host `host_id` of `num_hosts` reads.

    Args:
      pattern: glob pattern(s); comma-separated string or list.
      num_hosts: H.
      host_id: h in [0, H).
      seed: shuffle seed, identical on all hosts.

    Returns:
      This host's files: its balanced part of the seeded shuffle, or every file when
      there are fewer files than hosts (then read with record-level sharding).
    """
    _check_hosts(num_hosts, host_id)
    return _part(expand(pattern), num_hosts, host_id, seed)


def _part(files: list[str], num_hosts: int, host_id: int, seed: int) -> list[str]:
    """Host host_id's balanced part of the seeded shuffle (every file if fewer than hosts)."""
    files = list(files)
    if len(files) < num_hosts:
        return files
    random.Random(seed).shuffle(files)
    base, extra = divmod(len(files), num_hosts)
    start = host_id * base + min(host_id, extra)
    return files[start:start + base + (1 if host_id < extra else 0)]


@dataclasses.dataclass(frozen=True)
class HostShard:
    """What one host reads: its files, and record-level sharding when files are too few."""

    files: tuple[str, ...]
    num_hosts: int
    host_id: int
    record_shard: bool


def plan(pattern: str | Sequence[str], num_hosts: int, host_id: int, seed: int = 0) -> HostShard:
    """host_files, plus the record-level fallback (logged) for fewer files than hosts."""
    _check_hosts(num_hosts, host_id)
    everything = expand(pattern)
    files = _part(everything, num_hosts, host_id, seed)
    record_shard = num_hosts > 1 and len(everything) < num_hosts
    if record_shard:
        log.warning(
            "input %s: %d file(s) for %d hosts, so every host reads every file and keeps every %d-th record; "
            "write at least %d files for per-host file splitting", pattern, len(files), num_hosts, num_hosts, num_hosts,
        )
    return HostShard(tuple(files), num_hosts, host_id, record_shard)
