"""A hang watchdog for every host: a run whose step stops finishing exits, so that its supervisor
(tfpod.launch --max_restarts, examples/slurm/restart.sh, a JobSet) restarts it.

The Controller arms it before each call of the compiled loop and before the work between
calls (logging, saves, evaluations). A call may take `hang_factor` x the median call so far
(per step, at least `hang_min_s`); the first call (it compiles) and the work between calls
may take `hang_timeout_s`, the second call as long as the first (at least `hang_min_s`). Past its limit the watchdog writes one `error: hung` line naming
the step and what it was doing, every thread's Python stack (faulthandler), and ends the
process with EXIT_HUNG. A host stopped by the OS (SIGSTOP) cannot notice its own hang: the
other hosts, waiting for it in a collective, do.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time

EXIT_HUNG = 124  # (timeout(1)'s status for "timed out")


class Watchdog:
    """Ends the process when an armed deadline passes (see the module docstring).

    Args:
      timeout_s: the limit of the first call and of the work between calls (0: no watchdog).
      factor: a later call's limit as a multiple of the median call per step.
      min_s: the least limit of a later call.
    """

    def __init__(self, timeout_s: float, factor: float, min_s: float, exit=os._exit, out=None):
        self.timeout_s, self.factor, self.min_s = timeout_s, factor, min_s
        self._exit, self._out = exit, out
        self._per_step: list[float] = []  # seconds per step of each call after the first
        self._calls = 0
        self._first_s = None  # the first call's seconds (it compiles)
        self._deadline = None  # (time, limit, step, what) or None: disarmed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="tfpod-watchdog", daemon=True)
            self._thread.start()

    def call_limit(self, n: int) -> float:
        """The limit of a call of `n` steps."""
        if self._first_s is None:
            return self.timeout_s
        if not self._per_step:  # the second call: as long as the first (compiling) one, at least min_s
            return max(self.min_s, self._first_s)
        return max(self.min_s, self.factor * statistics.median(self._per_step[-100:]) * n)

    def before_call(self, step: int, n: int) -> None:
        """A call of the compiled loop training steps step+1..step+n starts."""
        self._arm(self.call_limit(n), step, f"training steps {step + 1}..{step + n}")

    def after_call(self, step: int, n: int, seconds: float) -> None:
        """That call took `seconds`; the work between calls starts (logging, saves, evaluations)."""
        self._calls += 1
        if self._calls > 1:  # the first call compiles
            self._per_step.append(seconds / max(1, n))
        else:
            self._first_s = seconds
        self._arm(self.timeout_s, step + n, f"after step {step + n} (logging, saving or evaluating)")

    def stop(self) -> None:
        with self._lock:
            self._deadline = None
        self._stop.set()

    def _arm(self, limit: float, step: int, what: str) -> None:
        with self._lock:
            self._deadline = (time.time() + limit, limit, step, what) if self.timeout_s > 0 else None

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, max(0.05, self.min_s / 10))):
            with self._lock:
                deadline = self._deadline
            if deadline is not None and time.time() > deadline[0]:
                self._fire(*deadline[1:])
                return

    def _fire(self, limit: float, step: int, what: str) -> None:
        out = self._out or sys.stderr
        print(f"error: hung: nothing finished in {limit:.1f} s ({what}, at step {step}): every thread's stack "
              f"follows; exiting with status {EXIT_HUNG} so that a supervisor restarts the run from the newest "
              "complete checkpoint (train.hang_timeout_s, train.hang_factor, train.hang_min_s)", file=out, flush=True)
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        self._exit(EXIT_HUNG)
