"""A fault injector for tests and soaks: TFPOD_FAULT names faults that fire once each in a run.

    TFPOD_FAULT=KIND@STEP[:HOST][=ARG],...      e.g. kill@6,hang@9:1,slow@3=0.5
    TFPOD_FAULT=random:SEED:COUNT[:KIND+KIND...]  COUNT faults at seeded random steps of the
                                                  run (train.steps), kinds and hosts drawn too

A fault fires on host HOST (default every host) before the call of the compiled loop that
trains step STEP (or, for the checkpoint kinds, at the save of step STEP):

  exception      raises RuntimeError (the process exits 1)
  kill           SIGKILL to this process
  hang           this host stops finishing steps (sleeps; the hang watchdog ends it)
  nonfinite      the step's loss weights (else its first floating-point feature) become
                 NaN: its loss is NaN (train.on_nonfinite decides)
  slow           this host sleeps ARG seconds (default 1) before every call from STEP on
  ckpt_fail      the checkpoint write of step STEP fails as a full disk's does
  ckpt_truncate  the checkpoint of step STEP is cut to half its data, then SIGKILL (a write
                 torn by a crash: the next launch must set it aside; synchronous saves)

Each fault fires once per run folder (model_dir/faults-host<h>.json records those fired), so
a restarted run goes past it: a supervisor's restart (tfpod.launch --max_restarts) then ends
the run exactly as an uninterrupted one. Every fault logs one `fault injected:` warning.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import random
import signal
import time

import numpy as np

from tfpod import UserError

log = logging.getLogger("tfpod")

KINDS = ("exception", "kill", "hang", "nonfinite", "slow", "ckpt_fail", "ckpt_truncate")
ENV = "TFPOD_FAULT"


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    host: int | None = None
    arg: float | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.step}" + (f":{self.host}" if self.host is not None else "")


def parse(text: str, steps: int, num_hosts: int) -> list[Fault]:
    """The faults TFPOD_FAULT names (see the module docstring).

    Raises:
      UserError: a malformed entry, an unknown kind, a step or host out of range.
    """
    if text.startswith("random:"):
        parts = text.split(":")
        try:
            seed, count = int(parts[1]), int(parts[2])
        except (IndexError, ValueError):
            raise UserError(f"{ENV}={text!r}: write random:SEED:COUNT[:KIND+KIND...]") from None
        kinds = parts[3].split("+") if len(parts) > 3 else [k for k in KINDS if k != "slow"]
        rng = random.Random(seed)
        text = ",".join(f"{rng.choice(kinds)}@{rng.randint(2, max(2, steps))}:{rng.randrange(num_hosts)}"
                        for _ in range(count))
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            head, _, arg = entry.partition("=")
            kind, _, where = head.partition("@")
            step, _, host = where.partition(":")
            fault = Fault(kind, int(step), int(host) if host else None, float(arg) if arg else None)
        except ValueError:
            raise UserError(f"{ENV}: {entry!r} is not KIND@STEP[:HOST][=ARG] (e.g. kill@6:1)") from None
        if kind not in KINDS:
            raise UserError(f"{ENV}: {entry!r}: the kinds are {', '.join(KINDS)}")
        if not 1 <= fault.step <= steps or (fault.host is not None and not 0 <= fault.host < num_hosts):
            raise UserError(f"{ENV}: {entry!r}: the step must be in 1..{steps} and the host in 0..{num_hosts - 1}")
        faults.append(fault)
    return faults


class Injector:
    """This host's faults of one run (no TFPOD_FAULT: none, and every hook does nothing)."""

    def __init__(self, model_dir: str, host: int, num_hosts: int, steps: int, text: str | None = None):
        text = os.environ.get(ENV, "") if text is None else text
        self.host, self.record = host, os.path.join(model_dir, f"faults-host{host}.json")
        self.faults = [f for f in parse(text, steps, num_hosts) if f.host in (None, host)] if text else []
        fired = set()
        if self.faults and os.path.exists(self.record):
            with open(self.record) as f:
                fired = set(json.load(f))
        self.pending = [f for f in self.faults if f.name not in fired]
        self.slow = 0.0

    def _fire(self, fault: Fault) -> None:
        self.pending.remove(fault)
        fired = sorted({f.name for f in self.faults} - {f.name for f in self.pending})
        tmp = f"{self.record}.tmp"
        with open(tmp, "w") as f:
            json.dump(fired, f)
        os.replace(tmp, self.record)
        log.warning("fault injected: %s on host %d (%s)", fault.name, self.host, ENV)

    def _due(self, kinds, first: int, last: int) -> list[Fault]:
        return [f for f in self.pending if f.kind in kinds and first <= f.step <= last]

    def before_call(self, step: int, n: int, batch: dict) -> dict:
        """Before the call training steps step+1..step+n: the faults due then; returns the batch
        (poisoned by a `nonfinite` fault: its step's loss weights NaN)."""
        for fault in self._due(("slow",), 1, step + n):
            self._fire(fault)
            self.slow = fault.arg if fault.arg is not None else 1.0
        if self.slow:
            time.sleep(self.slow)
        for fault in self._due(("exception", "kill", "hang"), step + 1, step + n):
            self._fire(fault)
            if fault.kind == "exception":
                raise RuntimeError(f"fault injected: {fault.name} ({ENV})")
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # hang: the watchdog (or the coordination service) ends the process
                time.sleep(3600)
        for fault in self._due(("nonfinite",), step + 1, step + n):
            self._fire(fault)
            floats = [k for k, v in batch.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]
            key = "weights" if "weights" in batch else (floats[0] if floats else None)
            if key is None:
                raise UserError(f"{ENV}: {fault.name}: this task's batches have no floating-point feature to poison")
            batch = dict(batch)
            values = np.array(batch[key], copy=True)  # [steps of the call, rows, ...]
            values[fault.step - step - 1] = np.nan
            batch[key] = values
        return batch

    def at_save(self, step: int, path: str, written: bool) -> None:
        """At the save of `step` (to `path`): before its write (`written` False) or after it."""
        for fault in self._due(("ckpt_fail",) if not written else ("ckpt_truncate",), step, step):
            self._fire(fault)
            if fault.kind == "ckpt_fail":
                raise OSError(28, f"No space left on device (fault injected: {fault.name}, {ENV})")
            for data in glob.glob(f"{path}.data-*"):
                with open(data, "r+b") as f:
                    f.truncate(os.path.getsize(data) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
