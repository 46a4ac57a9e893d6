"""SIGTERM (a scheduler's preemption notice) as a flag, from a process's first moment.

This module imports nothing heavy, so main() installs the handler before TensorFlow
loads: a notice during start-up, training or shutdown then ends the run with status 0
(the controller saves at the end of the step it is in; see `Preemption`), and a
second notice (cluster managers repeat it) only sets the flag again.

TensorFlow's multi-client runtime installs a SIGTERM handler of its own in C++ when it
starts (its coordination service's preemption notifier), which took SIGTERM away from
Python: hosts of a multi-host job ignored the notice. `reinstall` (called by
runtime.initialize once the runtime is up) puts this handler back.

At exit, SIGTERM is ignored: Python's finalization puts the default action back for
signals with a Python handler, so a repeated notice arriving while a preempted (saved)
process shut down killed it, and its launcher reported a host killed by SIGTERM.
"""

from __future__ import annotations

import atexit
import logging
import signal
from typing import Callable

log = logging.getLogger("tfpod")

_STATE = {"received": False, "installed": False, "exit_hook": False}


def _on_sigterm(signum, frame) -> None:
    del frame
    if not _STATE["received"]:
        log.warning("%s received: finishing this step, then saving a checkpoint and exiting",
                    signal.Signals(signum).name)
    _STATE["received"] = True


def install():
    """Installs the handler unless it is; returns the handler it replaced (None: nothing replaced)."""
    if _STATE["installed"]:
        return None
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: SIGTERM keeps its default action
        log.debug("SIGTERM handler not installed (not the main thread)")
        return None
    _STATE["installed"] = True
    if not _STATE["exit_hook"]:
        atexit.register(_ignore_at_exit)
        _STATE["exit_hook"] = True
    return previous


def _ignore_at_exit() -> None:
    """SIGTERM ignored from here on (finalization leaves an ignored signal alone; see the module docstring)."""
    if _STATE["installed"]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def uninstall(previous) -> None:
    """Restores the handler `install` returned."""
    signal.signal(signal.SIGTERM, previous)
    _STATE["installed"] = False


def catch_sigterm() -> bool:
    """From now on SIGTERM only sets the flag `received` reads (main.py calls this first thing).
    Returns whether the handler is installed (only the main thread can)."""
    install()
    return _STATE["installed"]


def reinstall() -> None:
    """Puts the handler back after a library replaced it at the C level (see the module docstring)."""
    if _STATE["installed"]:
        try:
            signal.signal(signal.SIGTERM, _on_sigterm)
        except ValueError:
            pass


def received() -> bool:
    """Whether this process received SIGTERM."""
    return _STATE["received"]


class Preemption:
    """SIGTERM (a scheduler's preemption notice) as a request to save and stop.

    While active, SIGTERM only sets a flag; the controller asks `requested()` after each
    call of the compiled loop, then saves a checkpoint and returns. On several hosts the
    hosts agree (`agree`, a collective: true when any host's flag is), so all stop after
    the same step even when the signal reaches them at different times. Used as a
    context manager around training; the handler stays when `catch_sigterm` installed
    it before.

    Args:
      agree: {this host's flag -> whether any host's is set}, e.g. tfpod.mesh.any_host on
        the run's mesh; None on one host.
    """

    def __init__(self, agree: Callable[[bool], bool] | None = None):
        self.agree = agree
        self._previous = None

    def __enter__(self) -> "Preemption":
        self._previous = install()  # None when catch_sigterm installed it first
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            uninstall(self._previous)
            self._previous = None

    @property
    def signaled(self) -> bool:
        """Whether this host received SIGTERM."""
        return received()

    def requested(self) -> bool:
        """Whether any host received SIGTERM (a collective when `agree` is given)."""
        return self.signaled if self.agree is None else self.agree(self.signaled)
