"""The inner trainer: a built, placed model and optimizer, and the compiled steps on them.

`Trainer` builds the task's model sharded by the placement's rules (nothing is
allocated before every variable is checked), under the run's precision policy (the
global policy is restored afterwards), its optimizer with the state laid out for the
placement (optimizers.Update), and the dropout generator; then compiles

  train_loop  up to `steps_per_loop` train steps (forward, loss, gradients, clipping,
              optimizer update) on a stack of batches without returning to Python;
  evaluate    the task's on-device metric over this host's eval batches, plus its
              host-side metrics (Task.host_eval_metrics).

Everything between calls (feeding, logging, checkpoints, the cadence) is the
Controller's (tfpod.controller).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from tfpod import compat, embedding, evaluation, optimizers, partitioning, pipeline, runtime
from tfpod.partitioning import Placement
from tfpod.precision import precision_policy
from tfpod.task import EvalContext, LossTerms, Task
from tfpod.train_state import TrainState


def accumulate(model, task: Task, microbatches: int = 1):
    """The executor of a step on one mesh: batch -> (loss, gradients), with microbatches.

    A step's loss is `task.loss_terms` over `task.loss_counts` of its whole batch. With
    microbatches > 1 each step's batch comes as [microbatches, rows / microbatches, ...]
    (`Placement.split_microbatches`): the counts are summed over the
    microbatches first, then each microbatch's share of the loss (its sums over the whole
    step's counts, its aux term over the microbatches) is differentiated in turn and the
    gradients summed: the loss and gradients of the unsplit batch (up to rounding; batch
    norm normalizes each microbatch), one microbatch's activations alive at a time.
    Dropout draws each microbatch's own masks. (With pipeline stages the executor is
    tfpod.pipeline's `Pipeline.loss_and_gradients`.)
    """
    variables = model.trainable_variables
    m = microbatches

    def share(batch, counts, index):
        """(this microbatch's share of the step's loss, its gradients)."""
        # (the gradient inside the microbatch's block too: a recomputed block (remat) runs its
        # forward again there, and must draw the same dropout masks and read the same weights)
        with partitioning.gathered_weights(), partitioning.microbatch(index):
            with tf.GradientTape() as tape:
                loss = task.loss_terms(model, batch, True).loss(counts, m)
            # IndexedSlices -> dense; an embedding table's stay rows (tfpod.embedding, issue 66)
            return loss, embedding.with_rows(variables, tape.gradient(loss, variables))

    def loss_and_gradients(batch):
        if m == 1:
            return share(batch, task.loss_counts(batch), None)
        take = lambda j: {k: tf.gather(v, j) for k, v in batch.items()}
        counts = LossTerms.step_counts([task.loss_counts(take(j)) for j in range(m)])
        loss, grads = share(take(0), counts, 0)  # the first outside the loop: its gradients' layouts start it

        def body(j, loss, grads):
            part, more = share(take(j), counts, j)
            return j + 1, loss + part, [g + h for g, h in zip(grads, more)]

        _, loss, grads = tf.while_loop(lambda j, *_: j < m, body, (tf.constant(1), loss, grads))
        return loss, grads

    return loss_and_gradients


def make_train_loop(loss_and_gradients, update: optimizers.Update, clip_norm: float | None, steps_per_loop: int,
                    placement: Placement, microbatches: int = 1, homes=None):
    """The compiled training loop: up to `steps_per_loop` steps per call, each the
    executor's loss and gradients (`accumulate`, or a pipeline's) and the one update
    (`optimizers.Update.step`: the norm, clipping, the update only when finite).

    On one mesh the steps run in a `tf.while_loop` over stacked batches: one compiled
    call per loop. A pipeline's step spans the stages' meshes, which DTensor cannot
    carry through a while loop ("CopyToMesh acrosses Clusters should have been lowered
    to DTensorSend/DTensorRecv"); unrolling the steps in the trace instead compiles n
    times as long for no faster step (docs/benchmarks.md, "Pipeline steps per call"),
    so with stages each step is one compiled call, and the loop over the call's steps
    runs on the host, fetching the losses once at its end.

    Returns:
      fn(batches, num_steps) -> (losses [steps_per_loop], grad_norms [steps_per_loop]);
      entries past num_steps are 0. On one mesh `batches` is the stack of the steps'
      batches; with stages it is a list of the steps' stage batches. Compiled with
      `placement.compile` (traced outside a placement's activation context, the step
      raises); `fn.experimental_get_tracing_count()` counts its traces.
    """

    def train_step(batch):
        if partitioning.active_context() is None:  # its activation annotations would silently do nothing
            raise RuntimeError("the train step was traced outside a placement's activation context: compile it "
                               "with Placement.compile")
        loss, grads = loss_and_gradients(batch)
        return update.step(loss, grads, clip_norm, placement, homes)

    if placement.num_stages > 1:
        step = placement.compile(train_step, microbatches)

        def host_loop(steps, num_steps):
            results = [step(batch) for batch in steps[:num_steps]]
            losses, norms = np.zeros([steps_per_loop], np.float32), np.zeros([steps_per_loop], np.float32)
            for i, (loss, norm) in enumerate(results):
                losses[i], norms[i] = runtime.to_host(loss), runtime.to_host(norm)
            return losses, norms

        host_loop.experimental_get_tracing_count = step.experimental_get_tracing_count
        return host_loop

    def train_loop(stacked, num_steps):
        def body(i, losses, norms):
            loss, norm = train_step({k: tf.gather(v, i) for k, v in stacked.items()})
            hot = tf.one_hot(i, steps_per_loop)
            return i + 1, losses + hot * tf.cast(loss, tf.float32), norms + hot * tf.cast(norm, tf.float32)

        zeros = tf.zeros([steps_per_loop])
        _, losses, norms = tf.while_loop(lambda i, *_: i < num_steps, body, (tf.constant(0), zeros, zeros))
        return losses, norms

    return placement.compile(train_loop, microbatches)


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
        (`make_train_loop`; with pipeline stages, placement.stages, tfpod.pipeline's step).
      schedule: the pipeline schedule, "gpipe" or "1f1b".
    """

    def __init__(self, task: Task, model_config, optimizer_config: optimizers.OptimizerConfig, placement: Placement,
                 total_steps: int, steps_per_loop: int, precision: str = "float32", seed: int = 0,
                 data_config=None, microbatches: int = 1, schedule: str = "gpipe"):
        self.task, self.model_config, self.placement = task, model_config, placement
        self.data_config = data_config
        self.optimizer_name, self.steps_per_loop = optimizer_config.name, steps_per_loop
        self.pipelined = placement.num_stages > 1
        self.microbatches = microbatches
        self.schedule = schedule
        stage_of = None
        if self.pipelined:
            stage_of = lambda model: pipeline.variable_stages(pipeline.staged_model(task, model), placement.num_stages)
        tf_keras.utils.set_random_seed(seed)
        with precision_policy(precision):
            self.model, self.specs, self.layouts = partitioning.build_sharded(
                lambda: task.build(model_config), task.input_signature(model_config), placement.mesh,
                task.axis_rules, placement.table, placement.stages, stage_of)
        # (the weights layers read gathered: the trainable ones, and with LoRA the base it froze too)
        weights = self.model.trainable_variables if task.lora is None else self.model.variables
        weights = embedding.dense_weights(self.model, weights)  # (issue 66: a table is never read whole)
        self.gathered = partitioning.gather_when_used(weights, placement.gather_axis)
        self.optimizer = optimizers.build_optimizer(optimizer_config, total_steps)
        self.update = optimizers.Update(self.optimizer, self.model.trainable_variables, placement.mesh,
                                        placement.update_axis)
        self.state_specs, self.state_layouts = self.update.state_specs()
        self.step = self.optimizer.iterations  # the global step
        self.state = TrainState(self.step, self.model, self.optimizer)  # what checkpoints hold
        self.dropout_layers = partitioning.replayable_dropout(self.model, self.step, seed)
        self._eval_step = None
        self.pipeline = None
        if self.pipelined:
            for v in self.model.variables:
                partitioning.stages.follow_active_mesh(v)
            self.update.follow_stages()
            self.state.save_through(self.model.variables + optimizers.slot_variables(self.optimizer)
                                    + self.update.shadow_list(), placement.mesh)
            self.pipeline = pipeline.Pipeline(pipeline.staged_model(task, self.model), task.loss_counts, placement,
                                              self.update.variables, schedule, microbatches)
            executor, homes = self.pipeline.loss_and_gradients, self.pipeline.homes
        else:
            executor, homes = accumulate(self.model, task, microbatches), None
        # --- tfpod.embedding (issue 66): a model with embedding tables trains through their sparse path
        self.tables = None
        if embedding.find_layers(self.model):
            embedding.training.check_supported(self.update, placement, microbatches)
            self.tables = embedding.Tables(self.model, placement, task.batch_axes(), self.optimizer)
            self._loop = embedding.make_train_loop(executor, self.update, optimizer_config.clip_norm, steps_per_loop,
                                                   placement, self.tables, task.batch_axes())
            return
        # ---
        self._loop = make_train_loop(executor, self.update, optimizer_config.clip_norm, steps_per_loop, placement,
                                     microbatches, homes)

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
        axes = self.task.batch_axes()
        if self.tables:  # tfpod.embedding (issue 66): lookups and sparse updates between the steps
            return self._loop(host_stack, num_steps)
        if self.pipeline:
            steps = [self.pipeline.to_stages({k: v[n] for k, v in host_stack.items()}, axes) for n in range(num_steps)]
            losses, norms = self._loop(steps, num_steps)
            return losses[:num_steps], norms[:num_steps]
        leading = 1
        if self.microbatches > 1:
            host_stack = self.placement.split_microbatches(host_stack, self.microbatches, axes, 1)
            leading = 2
        stacked = self.placement.to_global(host_stack, axes, leading_dims=leading)
        losses, norms = self._loop(stacked, tf.constant(num_steps, tf.int32))
        return runtime.to_host(losses)[:num_steps], runtime.to_host(norms)[:num_steps]

    def learning_rate(self) -> float:
        """The optimizer's learning rate at the current step."""
        return float(runtime.to_host(compat.decayed_lr(self.optimizer)))

    def _make_eval_step(self):
        task = self.task
        if self.pipeline:
            return evaluation.make_eval_step(self.pipeline.forward, task.eval_metric, lambda b: b,
                                             metric_batch=lambda b: b[-1])
        forward, model_inputs = lambda x: self.model(x, training=False), task.model_inputs
        if self.tables:  # tfpod.embedding (issue 66): the batch carries the tables' partial lookups
            forward, model_inputs = embedding.training.eval_forward(forward, model_inputs, self.tables)
        return evaluation.make_eval_step(forward, task.eval_metric, model_inputs, mesh=self.placement.mesh)

    def evaluate(self, host_batches: Sequence[Mapping[str, np.ndarray]], host_rows: int) -> dict:
        """One pass over this host's eval batches on the mesh: the task's metrics.

        Returns:
          {metric: value, "num_examples": the eval set's true size, "eval_steps"}.
        """
        task = self.task
        if self._eval_step is None:
            self._eval_step = self._make_eval_step()
        to_device = lambda b: self.placement.to_global(b, task.batch_axes())
        if self.pipeline:
            to_device = lambda b: self.pipeline.to_device(b, task.batch_axes())
        if self.tables:  # tfpod.embedding (issue 66)
            to_device = embedding.training.eval_to_device(self.tables, self.placement, task.batch_axes())
        info = runtime.info()
        context = EvalContext(self.model, self.model_config, self.placement, host_rows, info.client_id,
                              info.num_clients, self.data_config)
        with self.placement.activations(), partitioning.gathered_weights():
            result = evaluation.evaluate(self._eval_step, host_batches, host_rows, to_device, self.placement.mesh,
                                         task.eval_metric)
            result.update(task.host_eval_metrics(context, host_batches))
        return result
