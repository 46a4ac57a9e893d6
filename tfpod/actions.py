"""What the controller does after each call of the compiled loop: one action per concern
(Orbit's controller actions), each built from what it needs and usable on its own.

An action is an `Action`: its periodic condition `Every(n)` (Orbit's `ConditionalAction`)
says at which steps it runs and when it is next due, and the controller ends each call of
its compiled loop at the next step any of its actions wants (at most train.steps_per_loop
on). The controller runs a call, wraps its result in an `Outcome`, and gives it to its
actions in this order; an action may end the run (`Outcome.stop`) or roll it back to a
checkpoint (`Outcome.rolled_back_to`: the actions after it are skipped for that call):

    Nonfinite      train.on_nonfinite: stop, skip or roll back (tfpod.nonfinite)
    RunRecord      the run's record (layouts.txt, config.gin), once training has started
    Metrics        the steps' losses into the window; the step line and metrics.jsonl
                   at train.log_every; goodput so far
    Evaluation     the evaluation at train.eval_every and the target stop
    (the run's own actions: `tfpod.run(..., actions=[...])`, `Controller(..., actions=...)`)
    Preempt        the hosts' agreement on a preemption notice: save and stop after this call
    Checkpointing  the save at train.checkpoint_every and at the last step (input position
                   first, then the state; non-finite state rolls back or stops)
    MemorySnapshot the in-memory snapshot at train.memory_checkpoint_every between saves
                   (tfpod.memory_checkpoint)

A run's own action is one class with one argument:

    class Norms(tfpod.actions.Action):
        def run(self, outcome):
            print(outcome.end, float(outcome.norms.max()))

    tfpod.run(["gin/lm_tiny.gin"], [], "runs/demo", actions=[Norms(every=100)])

It runs after the evaluation and before the checkpoint of the call, on every host (an
action that writes files checks `tfpod.runtime.info().client_id`); setting `outcome.stop`
ends the run with a checkpoint of that step.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from typing import Callable, Mapping

import numpy as np

from tfpod import UserError, checkpoint, nonfinite, run_folder
from tfpod.preemption import Preemption

log = logging.getLogger("tfpod")


@dataclasses.dataclass(frozen=True)
class Every:
    """The steps an action runs at: the multiples of `steps` (None: the end of every call,
    wherever it falls), and when it is next due (Orbit's ConditionalAction's condition, which
    also answers 'when next').

    Attributes:
      steps: steps between runs (at least 1), or None.
    """

    steps: int | None = None

    def __post_init__(self):
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            raise UserError(f"an action's every={self.steps!r} must be a whole number of steps, at least 1 (None: "
                            "after every call of the compiled loop)")

    def due(self, step: int) -> bool:
        """Whether the action runs after a call that ends at `step`."""
        return self.steps is None or step % self.steps == 0

    def next(self, step: int) -> int | None:
        """The first step after `step` it is due at, where a call must end (None: wherever calls end)."""
        return None if self.steps is None else (step // self.steps + 1) * self.steps


@dataclasses.dataclass
class Outcome:
    """One call of the compiled loop as the actions see it.

    Attributes:
      step: the step before the call.
      losses, norms: each trained step's loss and gradient norm (host arrays).
      total_steps: train.steps.
      stop: why the run ends after this call ("target", "preempted"), or None.
      rolled_back_to: the checkpoint's step the run went back to, or None.
    """

    step: int
    losses: np.ndarray
    norms: np.ndarray
    total_steps: int
    stop: str | None = None
    rolled_back_to: int | None = None

    @property
    def end(self) -> int:
        """The step after the call."""
        return self.step + len(self.losses)

    @property
    def last(self) -> bool:
        """Whether the run ends after this call (train.steps reached, or a stop)."""
        return self.end >= self.total_steps or self.stop is not None


class Action:
    """What the controller does after a call of its compiled loop, when its condition says so.

    Subclass it and write `run`; `every` is its one argument (module docstring). The
    controller calls the action after every call (`__call__`), which runs it when `due`;
    `when` tells the controller where to end its calls, so a call never runs past a step
    the action wants.

    Args:
      every: steps between runs (None: after every call of the compiled loop).
    """

    def __init__(self, every: int | None = None):
        self.when = Every(every)

    def due(self, outcome: Outcome) -> bool:
        """Whether it runs after this call (its condition at the call's last step)."""
        return self.when.due(outcome.end)

    def __call__(self, outcome: Outcome) -> None:
        if self.due(outcome):
            self.run(outcome)

    def run(self, outcome: Outcome) -> None:
        """What it does; `outcome.end` is the step just trained."""
        raise NotImplementedError(f"{type(self).__name__}.run(outcome): write what the action does")


class Nonfinite(Action):
    """train.on_nonfinite after each call (tfpod.nonfinite.NonfiniteGuard)."""

    def __init__(self, guard: nonfinite.NonfiniteGuard):
        super().__init__()
        self.guard = guard

    def run(self, outcome: Outcome) -> None:
        outcome.rolled_back_to = self.guard.check(outcome.step, outcome.losses, outcome.norms)


class RunRecord(Action):
    """Writes the run's record once, after the first call that trains: a run that fails
    before training leaves the record of the run before it as it was."""

    def __init__(self, write: Callable[[], None]):
        super().__init__()
        self.write, self.written = write, False

    def due(self, outcome: Outcome) -> bool:
        return not self.written

    def run(self, outcome: Outcome) -> None:
        self.write()
        self.written = True


class Metrics(Action):
    """The steps' losses and gradient norms into the metrics window; at train.log_every (and
    the last step) the step line and metrics.jsonl record, and goodput so far.

    Args:
      writer: the run's MetricsWriter.
      log_every: train.log_every.
      learning_rate: () -> the optimizer's current learning rate.
      seconds_per_step: () -> the recent rate (None before one is measured).
      record_goodput: () -> None, what a killed launch keeps.
    """

    def __init__(self, writer, log_every: int, learning_rate: Callable[[], float],
                 seconds_per_step: Callable[[], float | None], record_goodput: Callable[[], object]):
        super().__init__(log_every)
        self.writer = writer
        self.learning_rate, self.seconds_per_step, self.record_goodput = learning_rate, seconds_per_step, record_goodput
        self.last_loss: float | None = None  # the last step line's loss (the window's mean)

    def __call__(self, outcome: Outcome) -> None:
        self.writer.add_steps(outcome.losses, outcome.norms)  # every call's steps go into the window
        super().__call__(outcome)

    def due(self, outcome: Outcome) -> bool:
        return self.when.due(outcome.end) or outcome.end == outcome.total_steps

    def run(self, outcome: Outcome) -> None:
        self.last_loss = self.writer.train(outcome.end, self.learning_rate(), self.seconds_per_step())["loss"]
        self.record_goodput()


class Evaluation(Action):
    """Evaluates at train.eval_every (and the last step); ends the run when the target is reached.

    Args:
      evaluate: (step, extra) -> the eval result (Controller.evaluate on the eval batches).
      config: TrainConfig (eval_every, steps, the target).
      lower_is_better: the task's metrics reached from above.
      started: when training started (time.time()), for the result's train_seconds.
    """

    def __init__(self, evaluate: Callable[[int, Mapping], dict], config, lower_is_better, started: float):
        super().__init__(config.eval_every)
        self.evaluate, self.config, self.lower_is_better, self.started = evaluate, config, lower_is_better, started

    def due(self, outcome: Outcome) -> bool:
        return self.when.due(outcome.end) or outcome.end == self.config.steps

    def run(self, outcome: Outcome) -> None:
        c, step = self.config, outcome.end
        result = self.evaluate(step, {"train_seconds": time.time() - self.started})
        if c.reached(result, self.lower_is_better):
            log.info("reached %s %s %.4f at step %d, %s after the start of training", c.target_metric,
                     "<=" if c.target_metric in self.lower_is_better else ">=", c.target_value, step,
                     datetime.timedelta(seconds=round(time.time() - self.started)))
            outcome.stop = "target"


class Preempt(Action):
    """Ends the run after this call when any host received a preemption notice (SIGTERM)."""

    def __init__(self, preemption: Preemption):
        super().__init__()
        self.preemption = preemption

    def run(self, outcome: Outcome) -> None:
        if self.preemption.requested():  # a collective on several hosts: every host calls it each time
            outcome.stop = outcome.stop or "preempted"


class Checkpointing(Action):
    """Saves at train.checkpoint_every and at the last step: the input position first, so the
    model checkpoint always has one, then the weights, optimizer state and step.

    During a streak of skipped non-finite steps a save waits for the next step that
    trains (older checkpoints are never rotated out for it), unless this is the last.
    Weights or slots that became non-finite stop the run, or roll back under "rollback".

    Args:
      checkpoints: the run's CheckpointManager.
      every: train.checkpoint_every.
      guard: the run's NonfiniteGuard (its streak, its rollback).
      feed: the run's feed (its `save(step)` writes the input position).
      model_dir: the run's folder (a folder another run took over is not written).
      saved: (seconds the save took, step) -> None (goodput and its record).
    """

    def __init__(self, checkpoints: checkpoint.CheckpointManager, every: int, guard: nonfinite.NonfiniteGuard, feed,
                 model_dir: str, saved: Callable[[float, int], None]):
        super().__init__(every)
        self.checkpoints, self.guard, self.feed = checkpoints, guard, feed
        self.model_dir, self.saved = model_dir, saved
        self.pending = False  # a save is owed from a step skipped as non-finite

    def due(self, outcome: Outcome) -> bool:
        return outcome.last or self.pending or self.when.due(outcome.end)

    def run(self, outcome: Outcome) -> None:
        step = outcome.end
        if self.guard.skipping and not outcome.last:
            if not self.pending:
                log.warning("step %d was skipped as non-finite: its checkpoint waits for the next step that trains",
                            step)
            self.pending = True
            return
        started = time.time()
        try:
            self.checkpoints.check_finite()
        except checkpoint.NonfiniteState as e:
            if self.guard.policy != "rollback":
                raise
            outcome.rolled_back_to = self.guard.roll_back(
                f"the weights or optimizer state became NaN or Inf at step {step} ({', '.join(e.variables[:3])})")
            return
        run_folder.check_held(self.model_dir)  # another run took the folder over: write nothing more
        self.feed.save(step)  # first, so the model checkpoint always has its input position
        self.checkpoints.save(checked=True)
        self.saved(time.time() - started, step)
        self.pending = False
        self.guard.saved()


class MemorySnapshot(Action):
    """Writes each host's in-memory snapshot (tfpod.memory_checkpoint) every `every` steps,
    unless a storage checkpoint of the step was just written or the step was skipped as
    non-finite; the last step has its storage checkpoint.

    Args:
      checkpoints: the run's CheckpointManager (with its `memory`).
      every: train.memory_checkpoint_every.
      guard: the run's NonfiniteGuard.
      feed: the run's feed (its `write_to(folder, step)` writes the input position).
      saved: (seconds the snapshot took, step) -> None (goodput).
    """

    def __init__(self, checkpoints: checkpoint.CheckpointManager, every: int, guard: nonfinite.NonfiniteGuard, feed,
                 saved: Callable[[float, int], None]):
        super().__init__(every)
        self.checkpoints, self.guard, self.feed, self.saved = checkpoints, guard, feed, saved

    def due(self, outcome: Outcome) -> bool:
        return (self.when.due(outcome.end) and not outcome.last and not self.guard.skipping
                and self.checkpoints.saved_step != outcome.end)

    def run(self, outcome: Outcome) -> None:
        self.saved(self.checkpoints.snapshot(self.feed.write_to), outcome.end)
