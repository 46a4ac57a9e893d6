"""Training: the compiled step and the outer loop that drives it.

`make_train_loop` returns the one compiled function: it runs up to
`train.steps_per_loop` train steps (forward, loss, gradients, clipping, optimizer
update) on a stack of batches without returning to Python. Everything else runs
eagerly on the host between calls, in `Trainer.train`: feeding the next stack of
batches, logging, metrics.jsonl, TensorBoard summaries and checkpoints.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import time
from typing import Callable, Iterator, Mapping

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tfpod import UserError, checkpoint, evaluation, flops, mesh as meshlib, optimizers, runtime, sharding
from tfpod.input import feed

log = logging.getLogger("tfpod")

PRECISIONS = ("float32", "mixed_bfloat16")
NONFINITE_POLICIES = ("stop", "skip", "rollback")


@dataclasses.dataclass
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

    def reached(self, result: Mapping[str, float]) -> bool:
        """Whether an eval result reaches the target (never without one)."""
        if self.target_metric is None or self.target_value is None:
            return False
        if self.target_metric not in result:
            raise UserError(f"train.target_metric={self.target_metric!r} is not an eval metric: use one of "
                            f"{', '.join(k for k, v in result.items() if isinstance(v, float))}")
        value = result[self.target_metric]
        lower_better = self.target_metric in ("loss", "perplexity")
        return value <= self.target_value if lower_better else value >= self.target_value

    def __post_init__(self):
        for field in ("steps", "global_batch_size", "steps_per_loop", "checkpoint_every", "log_every"):
            if getattr(self, field) < 1:
                raise UserError(f"train.{field}={getattr(self, field)} must be at least 1")
        if self.eval_every < 0:
            raise UserError(f"train.eval_every={self.eval_every} must be >= 0")
        if self.precision not in PRECISIONS:
            raise UserError(f"train.precision={self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise UserError(f"train.on_nonfinite={self.on_nonfinite!r}: use one of {', '.join(NONFINITE_POLICIES)}")
        if self.max_nonfinite < 1:
            raise UserError(f"train.max_nonfinite={self.max_nonfinite} must be at least 1")


def make_train_loop(model, update: optimizers.Update, loss_fn, clip_norm: float | None, steps_per_loop: int):
    """The compiled training loop: up to `steps_per_loop` steps per call.

    A step whose loss or gradient norm is NaN or Inf only advances the step counter:
    its update is not applied, so weights and optimizer slots keep finite values (what
    the run does next is `NonfiniteGuard`'s, on the host).

    Args:
      model: the sharded model.
      update: applies the gradients (its optimizer's state already created).
      loss_fn: (model, batch, training) -> (loss, metrics).
      clip_norm: global-norm gradient clipping (None or 0: off).
      steps_per_loop: the leading dimension of the stacked batches.

    Returns:
      fn(stacked_batches, num_steps) -> (losses [steps_per_loop], grad_norms
      [steps_per_loop]); entries past num_steps are 0.
    """
    variables = model.trainable_variables

    def train_step(batch):
        with tf.GradientTape() as tape, sharding.gathered_weights():
            loss, _ = loss_fn(model, batch, True)
        grads = tape.gradient(loss, variables)
        grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        if clip_norm:
            grads, norm = tf.clip_by_global_norm(grads, clip_norm)
        else:
            norm = tf.linalg.global_norm(grads)

        def skip():
            update.optimizer.iterations.assign_add(1)  # the batch is consumed; the step counter stays in step

        tf.cond(tf.math.is_finite(loss) & tf.math.is_finite(norm), lambda: update.apply(grads), skip)
        return loss, norm

    @tf.function
    def train_loop(stacked, num_steps):
        losses = tf.zeros([steps_per_loop])
        norms = tf.zeros([steps_per_loop])
        for i in tf.range(num_steps):
            batch = {k: tf.gather(v, i) for k, v in stacked.items()}
            loss, norm = train_step(batch)
            hot = tf.one_hot(i, steps_per_loop)
            losses += hot * tf.cast(loss, tf.float32)
            norms += hot * tf.cast(norm, tf.float32)
        return losses, norms

    return train_loop


def _nonfinite_text(loss: float, norm: float, step: int) -> str:
    if not np.isfinite(loss):
        return f"loss became {loss} at step {step}"
    return f"gradient norm became {norm} at step {step} (loss {loss:.4g})"


class NonfiniteGuard:
    """Applies train.on_nonfinite after each call of the compiled loop (see TrainConfig).

    The compiled step has already dropped the update of every step whose loss or
    gradient norm is not finite; this decides whether the run stops, goes on, or goes
    back to the newest checkpoint, and says so.
    """

    def __init__(self, cfg: TrainConfig, checkpoints: checkpoint.CheckpointManager):
        self.cfg, self.checkpoints = cfg, checkpoints
        self.skipping = 0  # skip: steps skipped in a row, across calls
        self.rollbacks = 0  # rollback: rollbacks since the last save

    def saved(self) -> None:
        self.rollbacks = 0

    def check(self, step: int, losses: np.ndarray, norms: np.ndarray) -> int | None:
        """Stops, skips (logs) or rolls back for the non-finite steps step+1... of one call.

        Returns:
          The step rolled back to, or None when training goes on from step + len(losses).
        """
        c = self.cfg
        bad = [(step + i + 1, float(x), float(n)) for i, (x, n) in enumerate(zip(losses, norms))
               if not (np.isfinite(x) and np.isfinite(n))]
        if c.on_nonfinite == "skip":
            for i, (x, n) in enumerate(zip(losses, norms)):
                if np.isfinite(x) and np.isfinite(n):
                    self.skipping = 0
                    continue
                self.skipping += 1
                if self.skipping > c.max_nonfinite:
                    self._stop(step + i + 1, float(x), float(n), f" after skipping {c.max_nonfinite} steps in a row")
                log.warning("%s: skipped its update (train.on_nonfinite='skip', %d in a row, at most %d)",
                            _nonfinite_text(float(x), float(n), step + i + 1), self.skipping, c.max_nonfinite)
            return None
        if not bad:
            return None
        first, loss, norm = bad[0]
        if c.on_nonfinite == "stop":
            self._stop(first, loss, norm)
        return self.roll_back(_nonfinite_text(loss, norm, first))

    def roll_back(self, what: str) -> int:
        """Restores the newest checkpoint (rollback policy) for `what` went non-finite; returns its step."""
        c = self.cfg
        self.rollbacks += 1
        if self.rollbacks > c.max_nonfinite:
            raise UserError(f"{what} after {c.max_nonfinite} rollback(s) without reaching a new checkpoint: "
                            f"{checkpoint.newest_checkpoint(self.checkpoints.latest)}; " + _FIXES)
        if self.checkpoints.latest is None:
            raise UserError(f"{what} with no checkpoint yet to roll back to; " + _FIXES)
        restored = self.checkpoints.restore_latest()
        log.warning("%s: rolled back to the checkpoint of step %d; training goes on with the next batches "
                    "(train.on_nonfinite='rollback', %d of %d)", what, restored, self.rollbacks, c.max_nonfinite)
        return restored

    def _stop(self, step: int, loss: float, norm: float, why: str = "") -> None:
        raise UserError(f"{_nonfinite_text(loss, norm, step)}{why}: its update was not applied; "
                        f"{checkpoint.newest_checkpoint(self.checkpoints.latest)}; {_FIXES}")


_FIXES = ("lower optimizer.learning_rate, raise optimizer.warmup_steps, set optimizer.clip_norm, or set "
          "train.on_nonfinite='skip' or 'rollback'")


class Trainer:
    """Builds the sharded model and optimizer, restores, trains, logs and checkpoints.

    Args:
      task: the model's task module/object (build, AXIS_RULES, input_signature, ...).
      model_config: the task's model config.
      train: TrainConfig.
      optimizer: OptimizerConfig.
      mesh: the global mesh.
      table: logical -> mesh axis rules table.
      model_dir: output directory.
      update_axis: mesh axis to shard the optimizer state and update over
        (weight-update sharding; None: laid out like each weight).
      gather_axis: mesh axis whose weight shards are gathered where the model uses
        them (the `2d` preset; None: weights are used as stored).
    """

    def __init__(self, task, model_config, train: TrainConfig, optimizer: optimizers.OptimizerConfig,
                 mesh: dtensor.Mesh, table: Mapping[str, str | None], model_dir: str, update_axis: str | None = None,
                 gather_axis: str | None = None):
        self.task, self.model_config, self.cfg, self.opt_cfg = task, model_config, train, optimizer
        self.mesh, self.table, self.model_dir = mesh, dict(table), model_dir
        self.info = runtime.info()
        self.is_chief = self.info.client_id == 0
        # () -> the corrupt input file, to name it in errors (set by whoever builds the input)
        self.corrupt_finder: Callable[[], str | None] | None = None
        os.makedirs(model_dir, exist_ok=True)

        batch_axis = feed.batch_mesh_axis(next(iter(task.batch_axes().values())), self.table, mesh)  # any feature
        self.host_rows = feed.host_rows(train.global_batch_size, mesh, batch_axis)
        self._local_shards = feed.local_shards(mesh, batch_axis)
        self._shard_rows = train.global_batch_size // (mesh.dim_size(batch_axis) if batch_axis else 1)
        self.seq_len = getattr(model_config, "seq_len", None)
        log.info("%s", meshlib.describe(mesh, train.global_batch_size, self.seq_len, batch_axis or "data"))

        tf_keras.utils.set_random_seed(train.seed)
        tf_keras.mixed_precision.set_global_policy(train.precision)
        try:
            self.model, self.specs, self.layouts = sharding.build_sharded(
                lambda: task.build(model_config), task.input_signature(model_config), mesh, task.AXIS_RULES, self.table
            )
        finally:
            tf_keras.mixed_precision.set_global_policy("float32")
        self.gathered = sharding.gather_when_used(self.model.trainable_variables, gather_axis)
        self.optimizer = optimizers.build_optimizer(optimizer, train.steps)
        self.update = optimizers.Update(self.optimizer, self.model.trainable_variables, mesh, update_axis)
        self.state_specs, self.state_layouts = self.update.state_specs()
        report = sharding.layout_report(self.specs, self.layouts, title=f"{task.NAME} variables")
        report += "\n" + sharding.layout_report(
            self.state_specs, self.state_layouts,
            title=f"{optimizer.name} optimizer state" + (f", update sharded over {update_axis!r}" if self.update.sharded else ""),
        )
        log.info("layouts:\n%s", report)
        self.layout_text = report  # written to model_dir/layouts.txt once training starts
        self._restored: tuple[int | None] | None = None
        self.step_var = self.optimizer.iterations
        self.checkpoints = checkpoint.CheckpointManager(
            model_dir, self.step_var, keep=train.keep_checkpoints, model=self.model, optimizer=self.optimizer
        )
        self.dropout_layers = checkpoint.replayable_dropout(self.model, self.step_var, train.seed)
        self._compiled_loop = make_train_loop(
            self.model, self.update, task.loss_and_metrics, optimizer.clip_norm, train.steps_per_loop)
        self._train_loop = self._compiled_loop
        self.tokens_per_step = train.global_batch_size * (self.seq_len or 1)
        self.flops_per_step = task.flops_per_token(model_config) * self.tokens_per_step
        per_device = train.peak_flops or flops.peak_flops_per_device(
            self.info.device_type, "bfloat16" if train.precision == "mixed_bfloat16" else "float32"
        )
        # Logical CPU devices share the host's cores, and the CPU peak is measured per host.
        units = self.info.num_clients if (self.info.device_type == "CPU" and not train.peak_flops) else self.info.num_global_devices
        self.peak_total = per_device * units
        self._writer = None  # TensorBoard's train/ writer, made at the first log line (host 0)

    def restore(self) -> int | None:
        """Restores the newest good checkpoint (if any) before anything is written; returns its step.

        `train` uses this restore instead of its own when it was called first, so a caller
        can check the checkpoint fits before writing its own files (main.py's config.gin).
        """
        self._restored = (self.checkpoints.restore_latest(),)
        return self._restored[0]

    @property
    def traces(self) -> int:
        """How many times the compiled train loop was traced (1 when it never recompiled)."""
        return self._compiled_loop.experimental_get_tracing_count()

    # -- data ---------------------------------------------------------------

    def synthetic_batches(self, start_step: int) -> Iterator[dict]:
        """This host's rows of synthetic global batches.

        Global batch s depends only on (seed, s), so it is the same for any number of
        hosts and devices, and a resumed run continues exactly; each host keeps the rows
        of its own batch shards.
        """
        step = start_step
        rows = np.concatenate([np.arange(i * self._shard_rows, (i + 1) * self._shard_rows) for i in self._local_shards])
        while True:
            rng = np.random.default_rng([self.cfg.seed, step])
            batch = self.task.synthetic_batch(self.model_config, self.cfg.global_batch_size, rng)
            yield {k: v[rows] for k, v in batch.items()}
            step += 1

    def _stack(self, batches: list[dict]) -> dict:
        n = self.cfg.steps_per_loop
        stacked = {}
        for k in batches[0]:
            arr = np.stack([b[k] for b in batches])
            if len(batches) < n:
                arr = np.concatenate([arr, np.zeros((n - len(batches),) + arr.shape[1:], arr.dtype)])
            stacked[k] = arr
        return feed.to_global(stacked, self.task.batch_axes(), self.table, self.mesh, leading_dims=1)

    # -- loop ---------------------------------------------------------------

    def _next_boundary(self, step: int) -> int:
        c = self.cfg
        marks = [c.steps, (step // c.log_every + 1) * c.log_every, (step // c.checkpoint_every + 1) * c.checkpoint_every]
        if c.eval_every:
            marks.append((step // c.eval_every + 1) * c.eval_every)
        return min(min(marks), step + c.steps_per_loop)

    def _dataset_batches(self, dataset_fn: Callable[[int], tf.data.Dataset], resumed: int | None,
                         checkpointable: bool, source: Mapping | None):
        """Host batches from this host's dataset; its position is checkpointed with the model."""
        iterator = iter(dataset_fn(self.host_rows))
        input_ckpt = None
        if checkpointable:
            source = {**(source or {}), "host_rows": self.host_rows, "seed": self.cfg.seed,
                      "hosts": self.info.num_clients, "host": self.info.client_id}
            make = lambda it: checkpoint.InputCheckpoint(self.model_dir, self.info.client_id, it,
                                                         self.cfg.keep_checkpoints, source)
            input_ckpt = make(iterator)
            if resumed is not None and input_ckpt.restore(resumed, strict=self.cfg.strict_resume) == "failed":
                iterator = iter(dataset_fn(self.host_rows))  # a new dataset: the failed restore may have left it half set
                input_ckpt = make(iterator)
        elif resumed is not None:
            if self.cfg.strict_resume:
                raise UserError("input read through the tf.data service cannot resume where it left off: unset its "
                                "service_address, or set train.strict_resume=False to start it over")
            log.warning("input read through the tf.data service cannot resume exactly: it restarts at step %d", resumed)

        def batches():
            while True:
                try:
                    batch = next(iterator)
                except StopIteration:
                    raise UserError(
                        "the input produced no (more) batches: the data holds fewer tokens than one host batch "
                        "(global_batch / hosts rows of seq_len + 1 tokens); add data or lower train.global_batch_size"
                    ) from None
                except tf.errors.DataLossError as e:
                    raise UserError(f"corrupt input data ({checkpoint.first_line(e)}): {self._corrupt_hint()}") from None
                yield {k: v.numpy() for k, v in batch.items()}

        return batches(), input_ckpt

    def _write_run_record(self, run_files: Mapping[str, str] | None) -> None:
        """layouts.txt and `run_files`, each written atomically by host 0 (see `train`)."""
        if self.is_chief:
            for name, text in {"layouts.txt": self.layout_text, **(run_files or {})}.items():
                checkpoint.write_atomically(os.path.join(self.model_dir, name), text)

    def _corrupt_hint(self) -> str:
        bad = self.corrupt_finder() if self.corrupt_finder else None
        where = f"file {bad} is corrupt" if bad else "one of this host's files is corrupt"
        data = getattr(self.task, "DATA", None)
        if data and "skip_corrupt" in {f.name for f in dataclasses.fields(self.task.DataConfig)}:
            return f"{where}; replace it, or set {data}.skip_corrupt=True to skip unreadable records"
        return f"{where}; replace it"

    def train(self, dataset_fn: Callable[[int], tf.data.Dataset] | None = None, checkpointable_input: bool = True,
              eval_batches: list | None = None, run_files: Mapping[str, str] | None = None,
              input_source: Mapping | None = None) -> dict:
        """Trains from the newest checkpoint (or from scratch) up to train.steps.

        Args:
          dataset_fn: host_rows -> this host's dataset of batches (None: synthetic data).
          checkpointable_input: whether the dataset's iterator can be checkpointed
            (not when fed by the tf.data service).
          eval_batches: this host's eval batches (train_and_eval): evaluated every
            train.eval_every steps; the run stops early when train.target_* is reached.
          run_files: {file name: text} the run's record in model_dir besides
            layouts.txt (main.py's config.gin): written by host 0, atomically, once the
            first call of the compiled loop has trained, so a run that fails before
            training leaves the record of the earlier run as it was.
          input_source: what the training input is built from (JSON-able; see
            checkpoint.InputCheckpoint): its saved position is restored only when this
            is the same.

        SIGTERM (preemption) during training finishes the current call of the compiled loop,
        saves a checkpoint and returns with "preempted" set; rerunning resumes from it.

        Returns:
          {"step": final step, "loss": last logged loss, "losses": every step's loss,
          "preempted": whether SIGTERM stopped the run}.
        """
        c = self.cfg
        resumed = self._restored[0] if self._restored is not None else self.checkpoints.restore_latest()
        self._restored = None
        step = resumed or 0
        if step >= c.steps:
            log.info("already at step %d of train.steps=%d: nothing to train", step, c.steps)
            return {"step": step, "loss": None, "losses": [], "preempted": False}
        input_ckpt = None
        if dataset_fn is None:
            batches = self.synthetic_batches(step)
        else:
            batches, input_ckpt = self._dataset_batches(dataset_fn, resumed, checkpointable_input, input_source)
        start_step, t_start = step, time.time()
        window_losses, window_steps, t_window = [], 0, time.time()
        rate = None  # seconds per step, excluding the first (compiling) call
        all_losses, last_loss = [], None
        first_call, traces_seen = True, self.traces
        nonfinite = NonfiniteGuard(c, self.checkpoints)
        preempted = pending_save = False
        window_skipped = 0

        def rewind(to: int) -> None:  # after a rollback: the weights, slots and step are the checkpoint's again
            nonlocal step, window_losses, window_steps, t_window, window_skipped
            del all_losses[max(0, to - start_step):]
            step, window_losses, window_steps, t_window, window_skipped = to, [], 0, time.time(), 0

        # A host lost in any collective below (step, preemption agreement, eval, save) is one error line.
        with runtime.stop_on_lost_host(lambda: self.checkpoints.latest), \
                sharding.activation_sharding(self.mesh, self.table), \
                checkpoint.Preemption(self.mesh, self.info.num_clients) as preemption:
            if preemption.requested():  # during start-up: nothing new to save
                log.warning("preempted before the first step: nothing new to save; rerun the same command to resume")
                return {"step": step, "loss": None, "losses": [], "preempted": True}
            while step < c.steps:
                n = self._next_boundary(step) - step
                stacked = self._stack([next(batches) for _ in range(n)])
                t_call = time.time()
                losses, norms = self._train_loop(stacked, tf.constant(n, tf.int32))
                losses = runtime.to_host(losses)[:n]
                norms = runtime.to_host(norms)[:n]
                dt = time.time() - t_call
                if self.traces > traces_seen:
                    if not first_call:  # shapes, dtypes or Python values changed between calls
                        log.warning("the train loop was traced again at step %d (trace %d): each trace recompiles "
                                    "it; feed batches of one shape and dtype", step, self.traces)
                    traces_seen = self.traces
                if not first_call:
                    rate = dt / n if rate is None else 0.7 * rate + 0.3 * dt / n
                rolled_back_to = nonfinite.check(step, losses, norms)
                if first_call:  # training has started: only now is the run's record written over
                    self._write_run_record(run_files)
                first_call = False
                if rolled_back_to is not None:
                    rewind(rolled_back_to)
                    continue
                step += n
                finite = np.isfinite(losses) & np.isfinite(norms)
                all_losses.extend(float(x) for x in losses)
                window_losses.extend(float(x) for x in losses[finite])
                window_skipped += int(n - finite.sum())
                window_steps += n
                if step % c.log_every == 0 or step == c.steps:
                    elapsed = time.time() - t_window
                    last_loss = float(np.mean(window_losses)) if window_losses else float("nan")
                    self._log_train(step, last_loss, float(norms[-1]), window_steps, elapsed, rate, window_skipped)
                    window_losses, window_steps, t_window, window_skipped = [], 0, time.time(), 0
                reached = False
                if eval_batches is not None and c.eval_every and (step % c.eval_every == 0 or step == c.steps):
                    result = self.evaluate(eval_batches, step, extra={"train_seconds": time.time() - t_start})
                    reached = c.reached(result)
                    if reached:
                        log.info("reached %s %s %.4f at step %d, %s after the start of training",
                                 c.target_metric, "<=" if c.target_metric in ("loss", "perplexity") else ">=",
                                 c.target_value, step, datetime.timedelta(seconds=round(time.time() - t_start)))
                preempted = preemption.requested()
                last = step == c.steps or reached or preempted
                if not (last or pending_save or step % c.checkpoint_every == 0):
                    continue
                if nonfinite.skipping and not last:  # never rotate older checkpoints out during a skip streak
                    if not pending_save:
                        log.warning("step %d was skipped as non-finite: its checkpoint waits for the next step that "
                                    "trains", step)
                    pending_save = True
                    continue
                try:
                    self.checkpoints.check_finite()
                except checkpoint.NonfiniteState as e:
                    if c.on_nonfinite != "rollback":
                        raise
                    rewind(nonfinite.roll_back(f"the weights or optimizer state became NaN or Inf at step {step} "
                                               f"({', '.join(e.variables[:3])})"))
                    continue
                if input_ckpt:
                    input_ckpt.save(step)  # first, so the model checkpoint always has its input position
                saved = self.checkpoints.save(checked=True)
                pending_save = False
                nonfinite.saved()
                if preempted:
                    log.warning("preempted: saved %s at step %d; rerun the same command to resume", saved, step)
                if reached or preempted:
                    break
        log.info(
            "trained steps %d..%d in %s; final loss %.4f",
            start_step, step, datetime.timedelta(seconds=round(time.time() - t_start)), all_losses[-1],
        )
        if self._writer:
            self._writer.flush()
        return {"step": step, "loss": last_loss, "losses": all_losses, "preempted": preempted}

    def evaluate(self, host_batches, step: int | None = None, extra: Mapping | None = None) -> dict:
        """One full pass over this host's eval batches on the mesh; logs and records it.

        Returns:
          {metric: value, "num_examples": true eval-set size, "eval_steps", "step"}.
        """
        if not hasattr(self, "_eval_step"):
            self._eval_step = evaluation.make_eval_step(self.model, self.task.EVAL_METRIC, self.task.model_inputs)
        to_device = lambda b: feed.to_global(b, self.task.batch_axes(), self.table, self.mesh)
        step = int(self.step_var.numpy()) if step is None else step
        t = time.time()
        with sharding.activation_sharding(self.mesh, self.table), sharding.gathered_weights():
            result = evaluation.evaluate(self._eval_step, host_batches, self.host_rows, to_device, self.mesh,
                                         self.task.EVAL_METRIC)
            decode_metrics = getattr(self.task, "decode_metrics", None)  # e.g. BLEU of decoded outputs
            if decode_metrics is not None:
                result.update(decode_metrics(self, host_batches))
        result["step"] = step
        if extra:
            result.update(extra)
            if self.cfg.target_metric is not None and self.cfg.target_value is not None:
                result["target_reached"] = self.cfg.reached(result)
        log.info("eval at step %d | %s | %d examples in %d steps, %.1fs", step,
                 " | ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float)),
                 result["num_examples"], result["eval_steps"], time.time() - t)
        if self.is_chief:
            record = {"kind": "eval", **result, "time": time.time()}
            with open(os.path.join(self.model_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
            writer = tf.summary.create_file_writer(os.path.join(self.model_dir, "eval"))
            with writer.as_default(step=step):
                for k, v in result.items():
                    if isinstance(v, float):
                        tf.summary.scalar(k, v)
            writer.flush()
        return result

    def _log_train(self, step: int, loss: float, grad_norm: float, steps: int, elapsed: float, rate: float | None,
                   skipped: int = 0):
        c = self.cfg
        steps_per_sec = steps / max(elapsed, 1e-9)
        examples_per_sec = steps_per_sec * c.global_batch_size
        tokens_per_sec = steps_per_sec * self.tokens_per_step
        mfu = flops.mfu(steps_per_sec * self.flops_per_step, self.peak_total)
        lr = float(runtime.to_host(self.optimizer._decayed_lr(tf.float32)))
        eta = datetime.timedelta(seconds=round((c.steps - step) * (rate if rate is not None else elapsed / steps)))
        log.info(
            "step %d/%d | loss %.4f | %s tokens/s | %.1f examples/s | mfu %.1f%% | lr %.2e | grad_norm %.3f | eta %s%s",
            step, c.steps, loss, f"{tokens_per_sec:,.0f}", examples_per_sec, 100 * mfu, lr, grad_norm, eta,
            f" | skipped {skipped} non-finite" if skipped else "",
        )
        if not self.is_chief:
            return
        record = {
            "kind": "train", "step": step, "loss": loss, "tokens_per_sec": tokens_per_sec,
            "examples_per_sec": examples_per_sec, "mfu": mfu, "time": time.time(),
            "learning_rate": lr, "grad_norm": grad_norm, "skipped_steps": skipped,
        }
        with open(os.path.join(self.model_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.model_dir, "train"))
        with self._writer.as_default(step=step):
            for key in ("loss", "tokens_per_sec", "examples_per_sec", "mfu", "learning_rate", "grad_norm"):
                tf.summary.scalar(key, record[key])
