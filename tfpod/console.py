"""What a user sees on the console: tfpod's progress lines and real errors, not start-up noise.

`setup` (main.py calls it before TensorFlow loads) routes the `tfpod` logger's lines
to stderr with a timestamp, and, unless `-v 1` or the user set TF_CPP_MIN_LOG_LEVEL,
hides TensorFlow's C++ log lines below FATAL (on a machine without CUDA: the cuInit
failure, oneDNN's DT_INT64 fallback, the cost estimator's matrix warnings, the
collectives' abort lines that follow a real error). `quiet` drops the lines other
libraries print on their own (absl's pre-init warning and INFO lines of a multi-host
start, Grappler's cost-model lines while a step compiles, SentencePiece's normalizer
line). Real errors reach the user as tfpod's one-line messages or Python tracebacks,
which none of this hides.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys

import tfpod


def setup(verbose: bool = False) -> None:
    """tfpod's lines on stderr; other libraries' chatter only when `verbose`."""
    from absl import logging as absl_logging

    if not verbose:
        absl_logging.set_verbosity(absl_logging.WARNING)
        logging.getLogger("tensorflow").setLevel(logging.WARNING)
        if tfpod.USER_TF_LOG_LEVEL is None:
            tfpod.set_tf_log_level("3")  # read when TensorFlow's C++ library loads, after this
    elif tfpod.USER_TF_LOG_LEVEL is None:
        tfpod.set_tf_log_level("0")
    logger = logging.getLogger("tfpod")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def child_env(env: dict | None = None) -> dict:
    """The environment for a child tfpod process (a host, main.py): this process's, less
    the TensorFlow log level tfpod set itself, so the child picks its own (`setup`)."""
    env = dict(os.environ if env is None else env)
    if tfpod.USER_TF_LOG_LEVEL is None:
        env.pop("TF_CPP_MIN_LOG_LEVEL", None)
        env.pop(tfpod._TF_LOG_LEVEL_MARK, None)
    return env


# Lines other libraries print on their own, at levels TF_CPP_MIN_LOG_LEVEL does not reach.
NOISE = re.compile("|".join([
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
    r"^[IW]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] ",  # absl C++ INFO and WARNING lines (the gRPC server's)
    # Grappler's cost model on DTensor's per-device shapes, while a step compiles; harmless.
    r"^E\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ op_level_cost_estimator\.cc:\d+\] Incompatible Matrix dimensions$",
    r"^\S*normalizer\.cc\(\d+\) LOG\(INFO\) ",  # SentencePiece, loading a model without a charsmap
]))

# The filter runs in its own small process, so that what a crashing process wrote last
# (a fatal C++ check, a Python traceback) still reaches the console: the filter reads
# until every writer is gone. It ignores SIGINT and SIGTERM (a scheduler signals the
# whole process group) and ends when the pipe closes.
_PUMP = r"""
import os, re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
noise = re.compile(sys.argv[1].encode())
for line in sys.stdin.buffer:
    if not noise.search(line.rstrip(b"\n")):
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
"""


class _Filter:
    """fd 2 of this process through a child process that drops NOISE lines, until `stop`."""

    def __init__(self):
        sys.stderr.flush()
        self.real = os.dup(2)
        read, write = os.pipe()
        self.child = subprocess.Popen([sys.executable, "-c", _PUMP, NOISE.pattern], stdin=read, stderr=self.real,
                                      close_fds=True)
        os.close(read)
        os.dup2(write, 2)
        os.close(write)

    def stop(self) -> None:
        sys.stderr.flush()
        os.dup2(self.real, 2)  # closes this process's last write end of the pipe: the child drains it and ends
        os.close(self.real)
        try:
            self.child.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a child of ours still holds the pipe open; it ends with it
            pass


@contextlib.contextmanager
def quiet(enabled: bool = True):
    """Within: NOISE lines are dropped from this process's stderr (everything else passes,
    in the order it is written)."""
    active = _Filter() if enabled else None
    try:
        yield
    finally:
        if active is not None:
            active.stop()
