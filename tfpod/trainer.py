"""The inner trainer: a built, placed model and optimizer, and the compiled steps on them.

`Trainer` picks the run's executor once (`executor_for`: tfpod.executor.OneMesh on one
mesh, tfpod.pipeline.Pipeline over stages, tfpod.embedding.executor.TablesExecutor for
embedding tables), builds the task's model sharded by the
placement's rules (nothing is allocated before every variable is checked), under the run's
precision policy (the global policy is restored afterwards), its optimizer with the state
laid out for the placement (optimizers.Update), and the dropout generator; then compiles

  train_loop  up to `steps_per_loop` train steps (the executor's loss and gradients, then
              the one update: the norm, clipping, the optimizer update) in the executor's
              loop of steps;
  evaluate    the task's on-device metric over this host's eval batches (the executor's
              eval forward), plus its host-side metrics (Task.host_eval_metrics).

Nothing here asks which executor it has. Everything between calls (feeding, logging,
checkpoints, the cadence) is the Controller's (tfpod.controller).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import tf_keras

from tfpod import UserError, compat, evaluation, optimizers, partitioning, runtime
from tfpod.embedding.executor import TablesExecutor
from tfpod.executor import Executor, LoopFn, OneMesh, StepFn
from tfpod.partitioning import Placement
from tfpod.pipeline import Pipeline
from tfpod.precision import precision_policy
from tfpod.task import EvalContext, Task
from tfpod.train_state import TrainState


def executor_for(task: Task, placement: Placement, microbatches: int = 1, schedule: str = "gpipe") -> Executor:
    """The run's executor, chosen once: a Pipeline over the placement's stages, TablesExecutor
    for a model with embedding tables, else OneMesh."""
    if task.sparse_tables:  # (it refuses stages, microbatches and a sharded update)
        return TablesExecutor(task, placement, microbatches)
    if placement.tables != "rows":
        raise UserError(f"sharding.tables={placement.tables!r}: task {task.name!r} has no embedding tables to place "
                        "(tasks with `sparse_tables`); drop the setting")
    if placement.num_stages > 1:
        return Pipeline(task, placement, microbatches, schedule)
    return OneMesh(task, placement, microbatches)


def make_train_step(executor: Executor, update: optimizers.Update, clip_norm: float | None) -> StepFn:
    """The train step, a plain function of a packed step batch: the executor's loss and
    gradients, then the one update (`optimizers.Update.step` where the executor's `homes`
    say: the norm, clipping, the update only when finite). Returns (loss, gradient norm)."""

    def train_step(batch):
        if partitioning.active_context() is None:  # its activation annotations would silently do nothing
            raise RuntimeError("the train step was traced outside a placement's activation context: compile it "
                               "with Placement.compile")
        loss, grads = executor.loss_and_gradients(batch)
        return update.step(loss, grads, clip_norm, executor.homes)

    return train_step


def make_train_loop(executor: Executor, update: optimizers.Update, clip_norm: float | None,
                    steps_per_loop: int) -> LoopFn:
    """The compiled training loop: up to `steps_per_loop` train steps (`make_train_step`) per
    call, in the executor's loop (one mesh: one compiled tf.while_loop over stacked batches;
    stages: one compiled call per step, looped on the host).

    Returns:
      fn(executor.to_device(host_stack, num_steps), num_steps) -> (losses, grad_norms) as
      host arrays [num_steps]. Compiled with `placement.compile` (traced outside a
      placement's activation context, the step raises); `fn.experimental_get_tracing_count()`
      counts its traces.
    """
    return executor.make_loop(make_train_step(executor, update, clip_norm), steps_per_loop)


class Trainer:
    """A task's model and optimizer on the mesh, and its compiled train loop and eval.

    Args:
      task: the task.
      model_config: its model config.
      optimizer_config: optimizers.OptimizerConfig.
      placement: mesh, rules table, update and gather axes.
      total_steps: the run's train.steps (the schedule's default length).
      steps_per_loop: train steps per call of `train_loop`.
      precision: float32, or mixed_bfloat16.
      seed: initialization and dropout.
      data_config: the task's data config, for its host-side eval metrics (EvalContext).
      microbatches: microbatches per step: their gradients accumulate into one update
        (tfpod.executor.Accumulation, with or without pipeline stages).
      schedule: the pipeline schedule, "gpipe" or "1f1b" (with stages).
    """

    def __init__(self, task: Task, model_config, optimizer_config: optimizers.OptimizerConfig, placement: Placement,
                 total_steps: int, steps_per_loop: int, precision: str = "float32", seed: int = 0,
                 data_config=None, microbatches: int = 1, schedule: str = "gpipe"):
        self.task, self.model_config, self.placement = task, model_config, placement
        self.data_config = data_config
        self.optimizer_name, self.steps_per_loop = optimizer_config.name, steps_per_loop
        self.microbatches = microbatches
        self.schedule = schedule
        self.executor = executor_for(task, placement, microbatches, schedule)
        tf_keras.utils.set_random_seed(seed)
        with precision_policy(precision):
            self.model, self.specs, self.layouts = partitioning.build_sharded(
                lambda: task.build(model_config), task.input_signature(model_config), placement.mesh,
                task.axis_rules, placement.table, placement.stages, self.executor.variable_stages,
                self.executor.variable_layouts)
        # (the weights layers read gathered: the trainable ones, and with LoRA the base it froze too)
        weights = self.model.trainable_variables if task.lora is None else self.model.variables
        self.gathered = partitioning.gather_when_used(weights, placement.gather_axis)
        self.optimizer = optimizers.build_optimizer(optimizer_config, total_steps)
        self.update = optimizers.Update(self.optimizer, self.model.trainable_variables, placement.mesh,
                                        placement.update_axis)
        self.state_specs, self.state_layouts = self.update.state_specs()
        self.step = self.optimizer.iterations  # the global step
        self.state = TrainState(self.step, self.model, self.optimizer)  # what checkpoints hold
        self.dropout_layers = partitioning.replayable_dropout(self.model, self.step, seed)
        self._eval_step = None
        self.executor.bind(self.model, self.update, self.state)
        self._loop = make_train_loop(self.executor, self.update, optimizer_config.clip_norm, steps_per_loop)

    def layout_report(self) -> str:
        """The layout report of the weights and the optimizer state (layouts.txt)."""
        stages = self.placement.stages
        report = partitioning.layout_report(self.specs, self.layouts, title=f"{self.task.name} variables",
                                            stages=stages)
        sharded = f", update sharded over {self.placement.update_axis!r}" if self.update.sharded else ""
        return report + "\n" + partitioning.layout_report(self.state_specs, self.state_layouts, stages=stages,
                                                          title=f"{self.optimizer_name} optimizer state{sharded}")

    @property
    def traces(self) -> int:
        """How many times the compiled train loop was traced (1 when it never recompiled)."""
        return self._loop.experimental_get_tracing_count()

    def train_loop(self, host_stack: Mapping[str, np.ndarray], num_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Runs `num_steps` steps on this host's stacked batches [steps_per_loop, rows, ...].

        Returns:
          (losses, gradient norms) of the steps, as host arrays [num_steps].
        """
        return self._loop(self.executor.to_device(host_stack, num_steps), num_steps)

    def learning_rate(self) -> float:
        """The optimizer's learning rate at the current step."""
        return float(runtime.to_host(compat.decayed_lr(self.optimizer)))

    def evaluate(self, host_batches: Sequence[Mapping[str, np.ndarray]], host_rows: int) -> dict:
        """One pass over this host's eval batches on the mesh: the task's metrics.

        Returns:
          {metric: value, "num_examples": the eval set's true size, "eval_steps"}.
        """
        task = self.task
        if self._eval_step is None:
            self._eval_step = evaluation.make_eval_step(self.executor.eval_forward, task.eval_metric)
        info = runtime.info()
        context = EvalContext(self.model, self.model_config, self.placement, host_rows, info.client_id,
                              info.num_clients, self.data_config)
        with self.placement.activations(), partitioning.gathered_weights():
            result = evaluation.evaluate(self._eval_step, host_batches, host_rows, self.executor.eval_to_device,
                                         self.placement.mesh, task.eval_metric)
            result.update(task.host_eval_metrics(context, host_batches))
        return result
