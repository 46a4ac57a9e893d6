"""Demo data sets, prepared on first use and cached: where, under which lock, written how.

Every demo set (the stdlib corpus of input.prepare, the digits of input.images, the
docstrings of input.translation) lives in a folder under `data_root()` and is prepared
once per machine: `ensure_prepared` takes a file lock beside the folder, and `staged`
writes into a temporary folder renamed into place when complete, so several processes
may ask at once and none reads a partial set. `demo_cli` is each module's command line.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Callable

from tfpod import UserError

log = logging.getLogger("tfpod")


def data_root() -> str:
    """$TFPOD_DATA_DIR, else the user cache folder ~/.cache/tfpod."""
    return os.environ.get("TFPOD_DATA_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tfpod")


def ensure_prepared(data_dir: str, ready: bool, prepare: Callable[[str], dict]) -> str:
    """`data_dir`, prepared first under the cache lock unless `ready` (prepare checks again inside)."""
    if not ready:
        with cache_lock(data_dir):
            prepare(data_dir)
    return data_dir


@contextlib.contextmanager
def staged(data_dir: str, prefix: str):
    """A temporary folder beside data_dir that becomes data_dir when the block completes.

    A prepared data set is written into it, then renamed into place (replacing an
    incomplete or forced-over earlier folder), so readers never see a partial one; on
    any error it is removed and data_dir is left as it was.
    """
    parent = os.path.dirname(os.path.abspath(data_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if os.path.exists(data_dir):
            shutil.rmtree(data_dir)  # only reached with force, or an incomplete earlier folder
        os.rename(tmp, data_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def cache_lock(data_dir: str):
    parent = os.path.dirname(os.path.abspath(data_dir))
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, "." + os.path.basename(data_dir) + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)



def demo_cli(prog: str, doc: str, default_dir: str, build: Callable[[str, bool], dict], argv=None) -> int:
    """The command line of a demo-data module: `--data_dir`, `--force`, build under the cache lock.

    Args:
      prog: e.g. "python -m tfpod.input.images".
      doc: the module docstring (its first line is the description).
      default_dir: where the data goes without --data_dir (named in --help).
      build: (data_dir, force) -> manifest, printed as JSON with the folder.
    """
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--data_dir", default=None, help=f"output folder (default: {default_dir})")
    parser.add_argument("--force", action="store_true", help="rebuild even if the demo data is there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    data_dir = args.data_dir or default_dir
    try:
        with cache_lock(data_dir):
            manifest = build(data_dir, args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"data_dir": data_dir, **manifest}))
    return 0
