"""The outer loop: cadence, evaluation and the target stop, checkpoints, preemption, what
non-finite steps do, and the metrics; around the compiled steps of a Trainer.

    controller = Controller(trainer, train_config, model_dir)
    controller.restore()                       # the newest good checkpoint, if any
    controller.train(feed, eval_batches=..., run_files={"config.gin": ...})

Each iteration: the feed gives the next call's batches (up to the next step any action
is due at, at most steps_per_loop), the trainer runs them in one call of its compiled
loop, then on the host its actions (tfpod.actions, `make_actions`): the non-finite
policy, the run's record (once training has started), the log line, the evaluation and
the target stop, the run's own actions (`actions=`), the hosts' agreement on a preemption
notice, and the checkpoint. Everything here runs eagerly.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from typing import Mapping, Sequence

import numpy as np

from tfpod import (UserError, actions as actionslib, checkpoint, feeding, flops, goodput, lora, mesh as meshlib,
                   nonfinite, faults, preemption, runtime, watchdog)
from tfpod.metrics_writer import MetricsWriter, Throughput
from tfpod.precision import PRECISIONS
from tfpod.trainer import Trainer

log = logging.getLogger("tfpod")



@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The run. Attributes map 1:1 to gin `train.<name>`.

    Attributes:
      steps: total optimizer steps of the run (a resumed run trains up to this).
      global_batch_size: examples per step over all hosts and devices.
      seed: seeds initialization, dropout and synthetic data.
      steps_per_loop: train steps per call of the compiled loop (host round trip).
      checkpoint_every: save every this many steps (and always at the end).
      eval_every: steps between evaluations in train_and_eval mode (0: never).
      log_every: log and write metrics every this many steps.
      synthetic_data: random batches of the experiment's shapes, no files read.
      keep_checkpoints: how many recent checkpoints to keep.
      precision: float32, or mixed_bfloat16 (bf16 compute, fp32 weights and loss).
      peak_flops: per-device peak FLOP/s for MFU (None: data sheet or measured).
      target_metric: train_and_eval stops when this eval metric reaches target_value
        (loss and perplexity: at or below; others: at or above).
      target_value: see target_metric.
      on_nonfinite: what a step whose loss or gradient norm is NaN or Inf does. Its update
        is never applied (the compiled step skips it) and no checkpoint is ever written of
        non-finite weights; then "stop" (exit naming the step and the newest checkpoint),
        "skip" (go on with the next batch) or "rollback" (restore the newest checkpoint
        and go on with the next batches, as Model Garden's loss-blowup recovery does).
      max_nonfinite: "skip": most steps skipped in a row; "rollback": most rollbacks
        before a new checkpoint is reached. One more stops the run.
      strict_resume: a resumed run whose input is not the one its checkpoint's input
        position was saved with (other files, format, batch, ...) stops with one line,
        instead of starting the new input from its beginning with a warning.
      microbatches: the global batch is split into this many microbatches whose gradients
        accumulate before one optimizer step, for every model (tfpod.trainer.make_train_loop:
        the unsplit batch's loss; batch norm normalizes each microbatch); with a `stage`
        mesh axis, the pipeline's microbatches (tfpod.pipeline).
      init_from: a checkpoint (a prefix such as D/checkpoints/ckpt-0, or a run's folder:
        its newest) whose model weights a run without checkpoints of its own starts from;
        its optimizer state and step are not read (fine-tuning). A run that has
        checkpoints resumes from them instead.
      async_checkpoint: at a save each host copies its own shards of the state off the
        devices and writes them in a background thread while training goes on
        (tfpod.checkpoint_writer); the next save, a restore, SIGTERM and the end of training
        wait for it. A checkpoint counts once it is whole, so keep_checkpoints complete
        ones stay on disk while one is written. On one host or many.
      hang_timeout_s: the hang watchdog (tfpod.watchdog): the first call of the compiled
        loop (it compiles) and the work between calls (logging, saves, evaluations) may take
        this long; past it the host writes every thread's stack and exits with status 124,
        for its supervisor to restart the run (tfpod.launch --max_restarts). 0: no watchdog.
      hang_factor: a later call may take this many times the median call (per step; the
        second call: as long as the first) ...
      hang_min_s: ... but at least this long.
      memory_checkpoint_every: every this many steps each host also writes a snapshot of its
        own shards and input position to local memory, and sends a copy to a peer host
        (tfpod.memory_checkpoint); a restart reads the newest of memory and storage. 0: off.
        Costs host memory of twice each host's shards of the state.
      memory_checkpoint_dir: where the snapshots go (None: /dev/shm/tfpod, RAM that outlives
        the process; elsewhere on systems without /dev/shm).
    """

    steps: int = 100
    global_batch_size: int = 8
    seed: int = 0
    steps_per_loop: int = 10
    checkpoint_every: int = 100
    eval_every: int = 0
    log_every: int = 10
    synthetic_data: bool = False
    keep_checkpoints: int = 3
    precision: str = "float32"
    peak_flops: float | None = None
    target_metric: str | None = None
    target_value: float | None = None
    on_nonfinite: str = "stop"
    max_nonfinite: int = 3
    strict_resume: bool = False
    microbatches: int = 1
    init_from: str | None = None
    async_checkpoint: bool = False
    hang_timeout_s: float = 1800.0
    hang_factor: float = 20.0
    hang_min_s: float = 60.0
    memory_checkpoint_every: int = 0
    memory_checkpoint_dir: str | None = None

    def reached(self, result: Mapping[str, float], lower_is_better=frozenset({"loss", "perplexity"})) -> bool:
        """Whether an eval result reaches the target (never without one); `lower_is_better`:
        the task's metrics reached from above (Task.lower_is_better)."""
        if self.target_metric is None or self.target_value is None:
            return False
        if self.target_metric not in result:
            raise UserError(f"train.target_metric={self.target_metric!r} is not an eval metric: use one of "
                            f"{', '.join(k for k, v in result.items() if isinstance(v, float))}")
        value = result[self.target_metric]
        lower_better = self.target_metric in lower_is_better
        return value <= self.target_value if lower_better else value >= self.target_value

    def __post_init__(self):
        for field in ("steps", "global_batch_size", "steps_per_loop", "checkpoint_every", "log_every", "microbatches"):
            if getattr(self, field) < 1:
                raise UserError(f"train.{field}={getattr(self, field)} must be at least 1")
        if self.eval_every < 0:
            raise UserError(f"train.eval_every={self.eval_every} must be >= 0")
        if self.precision not in PRECISIONS:
            raise UserError(f"train.precision={self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.on_nonfinite not in nonfinite.POLICIES:
            raise UserError(f"train.on_nonfinite={self.on_nonfinite!r}: use one of {', '.join(nonfinite.POLICIES)}")
        if self.hang_timeout_s < 0 or self.hang_factor < 1 or self.hang_min_s <= 0:
            raise UserError(f"train.hang_timeout_s={self.hang_timeout_s} (>= 0; 0: off), train.hang_factor="
                            f"{self.hang_factor} (>= 1) and train.hang_min_s={self.hang_min_s} (> 0) are out of range")
        if self.memory_checkpoint_every < 0:
            raise UserError(f"train.memory_checkpoint_every={self.memory_checkpoint_every} must be >= 0 (0: off)")
        if self.max_nonfinite < 1:
            raise UserError(f"train.max_nonfinite={self.max_nonfinite} must be at least 1")


class Controller:
    """Runs a Trainer: the loop, its checkpoints, evaluation and records in `model_dir`.

    Args:
      trainer: the built model, optimizer and compiled steps.
      config: TrainConfig.
      model_dir: the run's folder.
      actions: the run's own actions (tfpod.actions.Action), run after each call of the
        compiled loop after the built-in metrics and evaluation, before the checkpoint.
    """

    def __init__(self, trainer: Trainer, config: TrainConfig, model_dir: str, actions: Sequence = ()):
        for action in actions:
            if not isinstance(action, actionslib.Action):
                raise UserError(f"actions: {action!r} is a {type(action).__name__}, not a tfpod.actions.Action: "
                                "subclass it and write run(outcome)")
        self.trainer, self.cfg, self.model_dir, self.actions = trainer, config, model_dir, list(actions)
        self.info = runtime.info()
        self.is_chief = self.info.client_id == 0
        placement, task = trainer.placement, trainer.task
        batch_axes = next(iter(task.batch_axes().values()))  # the batch axis of any feature
        self.host_rows = placement.host_rows(config.global_batch_size, batch_axes)
        tokens = task.tokens_per_example(trainer.model_config)
        log.info("%s", meshlib.describe(placement.mesh, config.global_batch_size, tokens,
                                        placement.batch_axis(batch_axes) or "data", placement.table.get("height"),
                                        placement.num_stages, config.microbatches, trainer.schedule))
        summary = "\n".join(line for line in trainer.layout_report().splitlines() if line.startswith("#"))
        log.info("layouts (every variable: %s, written when training starts):\n%s",
                 os.path.join(model_dir, "layouts.txt"), summary)
        os.makedirs(model_dir, exist_ok=True)
        if task.lora is not None:  # LoRA on a base checkpoint: checkpoints hold the trained weights alone
            init_from = checkpoint.resolve(config.init_from, "train.init_from") if config.init_from else None
            resuming = bool(checkpoint.complete_steps(os.path.join(model_dir, "checkpoints")))
            trainer.state.base = lora.check_base(model_dir, init_from, resuming, self.is_chief)
            if trainer.state.base is not None:
                trainer.state.saved = lora.saved_weights(trainer.model)
        self.checkpoints = checkpoint.CheckpointManager(model_dir, trainer.state, keep=config.keep_checkpoints,
                                                        async_save=config.async_checkpoint,
                                                        memory_every=config.memory_checkpoint_every,
                                                        memory_dir=config.memory_checkpoint_dir)
        tokens_per_step = config.global_batch_size * (tokens or 1)
        per_device = config.peak_flops or flops.peak_flops_per_device(
            self.info.device_type, "bfloat16" if config.precision == "mixed_bfloat16" else "float32")
        # Logical CPU devices share the host's cores, and the CPU peak is measured per host.
        units = self.info.num_clients if (self.info.device_type == "CPU" and not config.peak_flops) \
            else self.info.num_global_devices
        self.writer = MetricsWriter(model_dir, self.is_chief, config.steps, Throughput(
            config.global_batch_size, tokens_per_step,
            task.step_flops_per_token(trainer.model_config, trainer.specs) * tokens_per_step,
            per_device * units))
        self._restored: tuple[int | None] | None = None

    def restore(self) -> int | None:
        """Restores the newest good checkpoint (if any) before anything is written; returns its step.

        `train` uses this restore instead of its own when it was called first.
        """
        self._restored = (self._resume(),)
        return self._restored[0]

    def _resume(self) -> int | None:
        """The newest checkpoint's step; without one, the weights of train.init_from (step None)."""
        step = self.checkpoints.restore_latest()  # (a LoRA run's: its base first, TrainState.base)
        adapters = self.trainer.task.lora
        path = checkpoint.resolve(self.cfg.init_from, "train.init_from") if self.cfg.init_from else None
        if self.cfg.init_from and step is not None:
            log.info("train.init_from=%s not read: resuming this run from its own step %d", self.cfg.init_from, step)
        elif self.cfg.init_from:
            self.checkpoints.restore_weights(path, "train.init_from", lora.is_adapter_key if adapters else None)
            log.info("weights from %s (train.init_from); the optimizer state and the step start fresh", path)
        elif adapters is not None and step is None:
            log.warning("lora.rank=%d without train.init_from: the adapters train on a freshly initialized base; "
                        "set train.init_from to a converted or trained checkpoint", adapters.rank)
        return step

    def synthetic_feed(self) -> feeding.SyntheticFeed:
        """This host's rows of synthetic batches of the task's shapes, seeded by (train.seed, step)."""
        t, c = self.trainer, self.cfg
        rows = t.placement.host_row_indices(c.global_batch_size, next(iter(t.task.batch_axes().values())))
        return feeding.SyntheticFeed(lambda rng: t.task.synthetic_batch(t.model_config, c.global_batch_size, rng),
                                     c.seed, rows)

    def dataset_feed(self, task_input) -> feeding.DatasetFeed:
        """This host's training dataset of `task_input`, its position checkpointed."""
        task = self.trainer.task
        return feeding.DatasetFeed(task_input, self.host_rows, self.model_dir, self.info.client_id,
                                   self.info.num_clients, self.cfg.seed, self.cfg.keep_checkpoints,
                                   self.cfg.strict_resume, task.data_name, task.skips_corrupt)

    def _agree(self, signaled: bool) -> bool:
        """The hosts' agreement on a preemption notice: whether any host received one."""
        return meshlib.any_host(signaled, self.trainer.placement.mesh)

    def _next_stop(self, step: int, run_actions: Sequence[actionslib.Action]) -> int:
        """The step the next call of the compiled loop ends at: the next step any action is
        due at (its `when`), at most train.steps_per_loop on and train.steps."""
        wanted = [action.when.next(step) for action in run_actions]
        return min([self.cfg.steps, step + self.cfg.steps_per_loop] + [w for w in wanted if w is not None])

    def _write_run_record(self, run_files: Mapping[str, str] | None) -> None:
        """layouts.txt and `run_files`, each written atomically by host 0 (see `train`)."""
        if self.is_chief:
            for name, text in {"layouts.txt": self.trainer.layout_report(), **(run_files or {})}.items():
                checkpoint.write_atomically(os.path.join(self.model_dir, name), text)

    def train(self, feed=None, eval_batches: list | None = None, run_files: Mapping[str, str] | None = None) -> dict:
        """Trains from the newest checkpoint (or from scratch) up to train.steps.

        Args:
          feed: this host's batches (feeding.DatasetFeed; None: synthetic_feed()).
          eval_batches: this host's eval batches (train_and_eval): evaluated every
            train.eval_every steps; the run stops early when train.target_* is reached.
          run_files: {file name: text} the run's record in model_dir besides
            layouts.txt (the run's config.gin): written by host 0, atomically, once the
            first call of the compiled loop has trained, so a run that fails before
            training leaves the record of the earlier run as it was.

        SIGTERM (preemption) during training finishes the current call of the compiled loop,
        saves a checkpoint and returns with "preempted" set; rerunning resumes from it.

        Returns:
          {"step": final step, "loss": last logged loss, "losses": every step's loss,
          "preempted": whether SIGTERM stopped the run}.
        """
        c = self.cfg
        resumed = self._restored[0] if self._restored is not None else self._resume()
        self._restored = None
        step = resumed or 0
        if step >= c.steps:
            log.info("already at step %d of train.steps=%d: nothing to train", step, c.steps)
            return {"step": step, "loss": None, "losses": [], "preempted": False}
        feed = feed or self.synthetic_feed()
        batches = feed.start(step, resumed, self.checkpoints.restored_input)
        start_step, t_start = step, time.time()
        losses_so_far = []
        progress = goodput.Goodput(self.model_dir, self.is_chief)
        progress.begin(step)
        self._rate, self._traces_seen, self._calls = None, self.trainer.traces, 0
        self.writer.reset_window()
        hang = watchdog.Watchdog(c.hang_timeout_s, c.hang_factor, c.hang_min_s)
        injector = faults.Injector(self.model_dir, self.info.client_id, self.info.num_clients, c.steps)
        self.checkpoints.fault = injector.at_save if injector.pending else None

        try:  # (the watchdog stops however training ends)
            # A host lost in any collective below (step, preemption agreement, eval, save) is one error line.
            with runtime.stop_on_lost_host(lambda: self.checkpoints.latest), \
                    preemption.Preemption(self._agree if self.info.num_clients > 1 else None) as preempt:
                if preempt.requested():  # during start-up: nothing new to save
                    log.warning("preempted before the first step: nothing new to save; rerun the same command to "
                                "resume")
                    return {"step": step, "loss": None, "losses": [], "preempted": True}
                run_actions, metrics = self.make_actions(feed, eval_batches, run_files, preempt, t_start, progress)
                step, stop = self._calls_until_done(step, batches, run_actions, losses_so_far, hang, injector, progress)
        finally:
            hang.stop()
        preempted = stop == "preempted"
        self._finish(step, start_step, t_start, losses_so_far, progress, preempted)
        return {"step": step, "loss": metrics.last_loss, "losses": losses_so_far, "preempted": preempted}

    def _calls_until_done(self, step: int, batches, run_actions: Sequence[actionslib.Action], losses_so_far: list,
                          hang: watchdog.Watchdog, injector: faults.Injector, progress: goodput.Goodput
                          ) -> tuple[int, str | None]:
        """Calls the compiled loop from `step` until train.steps or an action stops the run, each
        call's outcome handed to the actions in order (a rollback restarts from its step);
        `losses_so_far` gets each trained step's loss. Returns (the final step, why it stopped
        early: the last outcome's `stop`, or None)."""
        c, start_step = self.cfg, step
        while step < c.steps:
            n = self._next_stop(step, run_actions) - step
            hang.before_call(step, n)
            batch = injector.before_call(step, n, feeding.stack([next(batches) for _ in range(n)], c.steps_per_loop))
            losses, norms = self._call(batch, n, step)
            hang.after_call(step, n, self._last_call_s)
            progress.steps(n, self._last_call_s, step + n)
            outcome = actionslib.Outcome(step, losses, norms, c.steps)
            for action in run_actions:
                action(outcome)
                if outcome.rolled_back_to is not None:
                    break
            if outcome.rolled_back_to is not None:  # the weights, slots and step are the checkpoint's again
                del losses_so_far[max(0, outcome.rolled_back_to - start_step):]
                step = outcome.rolled_back_to
                self.writer.reset_window()
                continue
            step = outcome.end
            losses_so_far.extend(float(x) for x in losses)
            if outcome.last:
                return step, outcome.stop
        return step, None

    def _finish(self, step: int, start_step: int, started: float, losses: list, progress: goodput.Goodput,
                preempted: bool) -> None:
        """After the last call: background writes complete, the goodput and summary lines."""
        self.checkpoints.wait()  # a checkpoint written in the background (train.async_checkpoint) is complete
        if self.checkpoints.memory is not None:
            self.checkpoints.memory.wait_sent()
        summary = progress.record()
        self.writer.goodput(step, summary)
        log.info("%s", goodput.Goodput.line(summary))
        if preempted:
            log.warning("preempted: saved %s at step %d; rerun the same command to resume", self.checkpoints.latest,
                        step)
        log.info(
            "trained steps %d..%d in %s; step %d's own loss %.4f (a step line's: the mean since the line before)",
            start_step, step, datetime.timedelta(seconds=round(time.time() - started)), step, losses[-1],
        )
        self.writer.flush()

    def make_actions(self, feed, eval_batches: list | None, run_files: Mapping[str, str] | None,
                     preempt: preemption.Preemption, started: float, progress: goodput.Goodput
                     ) -> tuple[list[actionslib.Action], actionslib.Metrics]:
        """The actions after each call of the compiled loop, in order (tfpod.actions): the
        built-in ones with the run's own (`actions`) after the evaluation; and the Metrics
        action among them (its `last_loss` is the run's result). `progress`: the launch's goodput."""
        c, trainer = self.cfg, self.trainer
        guard = nonfinite.NonfiniteGuard(c.on_nonfinite, c.max_nonfinite, self.checkpoints)

        def saved(seconds: float, step: int) -> None:
            progress.add("checkpoint", seconds)
            self.writer.goodput(step, progress.record())

        def evaluate(step: int, extra: Mapping) -> dict:
            began = time.time()
            result = self.evaluate(eval_batches, step, extra)
            progress.add("eval", time.time() - began)
            return result

        metrics = actionslib.Metrics(self.writer, c.log_every, trainer.learning_rate, lambda: self._rate,
                                     progress.record)
        out = [actionslib.Nonfinite(guard), actionslib.RunRecord(lambda: self._write_run_record(run_files)), metrics]
        if eval_batches is not None and c.eval_every:
            out.append(actionslib.Evaluation(evaluate, c, trainer.task.lower_is_better, started))
        out += self.actions
        out += [actionslib.Preempt(preempt),
                actionslib.Checkpointing(self.checkpoints, c.checkpoint_every, guard, feed, self.model_dir, saved)]
        if c.memory_checkpoint_every:
            out.append(actionslib.MemorySnapshot(self.checkpoints, c.memory_checkpoint_every, guard, feed, saved))
        return out, metrics

    def _call(self, stacked: Mapping[str, np.ndarray], n: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """One call of the compiled loop: its losses and gradient norms. Keeps the rate of the
        calls after the first (compiling) one, and warns when a later call traced again."""
        t = self.trainer
        t_call = time.time()
        losses, norms = t.train_loop(stacked, n)
        dt = self._last_call_s = time.time() - t_call
        if self._calls:
            if t.traces > self._traces_seen:  # shapes, dtypes or Python values changed between calls
                log.warning("the train loop was traced again at step %d (trace %d): each trace recompiles it; feed "
                            "batches of one shape and dtype", step, t.traces)
            self._rate = dt / n if self._rate is None else 0.7 * self._rate + 0.3 * dt / n
        self._traces_seen, self._calls = t.traces, self._calls + 1
        return losses, norms

    def evaluate(self, host_batches, step: int | None = None, extra: Mapping | None = None) -> dict:
        """One full pass over this host's eval batches on the mesh; logs and records it.

        Returns:
          {metric: value, "num_examples": true eval-set size, "eval_steps", "step"}.
        """
        step = int(self.trainer.step.numpy()) if step is None else step
        started = time.time()
        result = self.trainer.evaluate(host_batches, self.host_rows)
        result["step"] = step
        if extra:
            result.update(extra)
            if self.cfg.target_metric is not None and self.cfg.target_value is not None:
                result["target_reached"] = self.cfg.reached(result, self.trainer.task.lower_is_better)
        self.writer.eval(result, time.time() - started)
        return result
