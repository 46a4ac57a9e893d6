"""SIGTERM (a scheduler's preemption notice) as a flag, from a process's first moment.

This module imports nothing heavy, so main() installs the handler before TensorFlow
loads: a notice during start-up, training or shutdown then ends the run with status 0
(the trainer saves at the end of the step it is in; see checkpoint.Preemption), and a
second notice (cluster managers repeat it) only sets the flag again.

TensorFlow's multi-client runtime installs a SIGTERM handler of its own in C++ when it
starts (its coordination service's preemption notifier), which took SIGTERM away from
Python: hosts of a multi-host job ignored the notice. `reinstall` (called by
runtime.initialize once the runtime is up) puts this handler back.
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("tfpod")

_STATE = {"received": False, "installed": False}


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
    return previous


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
