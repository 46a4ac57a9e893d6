"""Goodput: the share of a run's wall time, over all its launches, that trained steps which count.

Host 0 keeps the run's history in model_dir/goodput.json, one record per launch
(rewritten atomically at every log line, save and evaluation, so a launch that is
killed keeps what it had reached):

  start, last        the launch's start (`launch_start`) and the last time it recorded
  first_step         the step it resumed from (0 for the first launch)
  last_step          the last step it trained
  startup_s          the launch's start to the first call of the compiled loop
  compile_s          the first call's time beyond a steady call of as many steps
  productive_s       steady time of the steps it trained
  checkpoint_s       saves (the part that blocks training), and input positions
  eval_s             evaluations
  restart            the launcher's automatic restart this launch is (TFPOD_RESTART, set by
                     `tfpod.launch --max_restarts`; 0: started by a person)

A launch resumed from step s re-trains the steps its predecessors trained past s: their
productive time is lost to the restart. So, over all launches:

  wall    = from the first launch's process start to the newest record
  goodput = (productive - lost to restarts) / wall
  badput  = startup, compile, checkpoints, evaluation, lost to restarts, between launches
            (from a launch's last record to the next one's process start: a killed
            launch's last moments, launches killed before they restored a checkpoint, and
            the wait for a relaunch), and the rest (input waits, logging, restoring)

metrics.jsonl gets a record {"kind": "goodput", "step", "goodput", "wall_s", "launches",
"restarts" (automatic ones), "badput": {cause: share of wall time}} at every save and at the end, and the end of a
run logs the summary.
"""

from __future__ import annotations

import json
import logging
import os
import time

from tfpod import run_folder

log = logging.getLogger("tfpod")

FILE = "goodput.json"
CAUSES = ("startup", "compile", "checkpoints", "evaluation", "lost_to_restarts", "between_launches", "other")


_LAUNCH = {"start": None}


def mark_launch(start: float | None = None) -> None:
    """Marks when this launch began (main.py: the process start; api.run: its call), unless marked."""
    if _LAUNCH["start"] is None:
        _LAUNCH["start"] = time.time() if start is None else start


def _take_launch_start() -> float:
    start, _LAUNCH["start"] = _LAUNCH["start"], None
    return time.time() if start is None else start


def launch_start() -> float:
    """When this launch of main.py began: for an automatic restart, when `tfpod.launch` started
    it (TFPOD_LAUNCH_TIME, with TFPOD_RESTART > 0); otherwise when the interpreter began, as
    tfpod sees it (`tfpod.IMPORTED`: main.py's first import, tens of milliseconds in).

    Not the process's start in /proc: a shell that ends in `python main.py` (`sh -c "pip
    install ... && python main.py"`, container entrypoints, SLURM scripts) execs it, so the
    process, and its start time, are the shell's, and the shell's work would count as the
    run's start-up.
    """
    import tfpod

    if tfpod.LAUNCHED and int(os.environ.get("TFPOD_RESTART", "0") or 0) > 0:
        try:
            return min(float(tfpod.LAUNCHED), tfpod.IMPORTED)
        except ValueError:
            log.warning("TFPOD_LAUNCH_TIME=%r is not a time: goodput counts this restart from the interpreter's "
                        "start", tfpod.LAUNCHED)
    return tfpod.IMPORTED


def summarize(launches: list[dict]) -> dict:
    """Goodput and badput shares of a history of launches (see the module docstring)."""
    wall = max(0.0, launches[-1]["last"] - launches[0]["start"]) if launches else 0.0
    lost = between = 0.0
    for before, launch in zip(launches, launches[1:]):
        between += max(0.0, launch["start"] - before["last"])
        # the steps the predecessor trained past the resume point
        again = max(0, before["last_step"] - max(before["first_step"], launch["first_step"]))
        lost += before["productive_s"] * again / max(1, before["last_step"] - before["first_step"])
    productive = sum(l["productive_s"] for l in launches) - lost
    parts = {"startup": sum(l["startup_s"] for l in launches), "compile": sum(l["compile_s"] for l in launches),
             "checkpoints": sum(l["checkpoint_s"] for l in launches), "evaluation": sum(l["eval_s"] for l in launches),
             "lost_to_restarts": lost, "between_launches": between}
    parts["other"] = max(0.0, wall - productive - sum(parts.values()))
    share = (lambda x: x / wall) if wall > 0 else (lambda x: 0.0)
    return {"goodput": share(productive), "wall_s": wall, "productive_s": productive, "launches": len(launches),
            "restarts": sum(1 for l in launches if l.get("restart")),
            "badput": {k: share(v) for k, v in parts.items()}}


class Goodput:
    """One launch's share of the run's history (host 0 writes it; every host may count)."""

    def __init__(self, model_dir: str, chief: bool):
        self.path, self.chief = os.path.join(model_dir, FILE), chief
        self.history = []
        if os.path.isfile(self.path):
            try:
                with open(self.path) as f:
                    self.history = json.load(f)["launches"]
                if not isinstance(self.history, list) or not all(isinstance(l, dict) for l in self.history):
                    raise ValueError("its launches are not a list of records")
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.history = []
                moved = run_folder.move_aside(self.path) if chief else "*.corrupt.* by host 0"
                log.warning("%s is damaged (%s): moved it to %s; goodput counts from this launch on (the earlier "
                            "launches' figures are in the moved file and metrics.jsonl)", self.path,
                            " ".join(str(e).split())[:120] or type(e).__name__, moved)
        self.launch = None
        self._first_call = None

    def begin(self, step: int) -> None:
        """This launch starts training at `step` (restored, or 0)."""
        now = time.time()
        self.launch = {"start": min(_take_launch_start(), now), "last": now, "first_step": step, "last_step": step,
                       "startup_s": 0.0, "compile_s": 0.0, "productive_s": 0.0, "checkpoint_s": 0.0, "eval_s": 0.0,
                       "restart": int(os.environ.get("TFPOD_RESTART", "0") or 0)}
        self.record()  # a launch killed while it compiles still counts (a launch killed before this does not)

    def steps(self, n: int, seconds: float, step: int) -> None:
        """A call of the compiled loop trained `n` steps, up to `step`, in `seconds`."""
        l = self.launch
        if self._first_call is None:  # compiling: counted once a steady call gives the rate
            self._first_call = (n, seconds, time.time() - seconds)
            l["startup_s"] = max(0.0, self._first_call[2] - l["start"])
        else:
            if self._first_call[0]:
                first_n, first_s, _ = self._first_call
                steady = min(first_s, first_n * seconds / n)
                l["productive_s"] += steady
                l["compile_s"] += first_s - steady
                self._first_call = (0, 0.0, 0.0)
            l["productive_s"] += seconds
        l["last_step"] = step

    def add(self, cause: str, seconds: float) -> None:
        """Time spent on "checkpoint" or "eval"."""
        self.launch[f"{cause}_s"] += seconds

    def record(self) -> dict:
        """Writes the history (host 0) and returns the run's goodput so far."""
        self.launch["last"] = time.time()
        l = dict(self.launch)
        if self._first_call and self._first_call[0]:  # only the compiling call so far: count it as compile
            l["compile_s"] += self._first_call[1]
        launches = self.history + [l]
        if self.chief:
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"launches": launches}, f, indent=1)
            os.replace(tmp, self.path)
        return summarize(launches)

    @staticmethod
    def line(summary: dict) -> str:
        """The end-of-run summary line."""
        bad = ", ".join(f"{k.replace('_', ' ')} {v:.1%}" for k, v in summary["badput"].items())
        restarts = f" ({summary['restarts']} automatic restart(s))" if summary.get("restarts") else ""
        return (f"goodput {summary['goodput']:.1%} over {summary['launches']} launch(es){restarts}, "
                f"{summary['wall_s']:.0f} s of wall time; badput: {bad}")
