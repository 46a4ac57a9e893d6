"""How a run's train steps execute: the executor interface, one-mesh accumulation, and
gradient accumulation written once.

A train step is an executor's loss and gradients followed by the one update
(tfpod.optimizers.Update.step); the Trainer (tfpod.trainer) picks the executor once per
run and never asks which one it has. Three implement the interface:

  OneMesh         the step on one mesh, its microbatches accumulated in a tf.while_loop,
                  and `steps_per_loop` steps in one compiled tf.while_loop over stacked batches;
  Pipeline        (tfpod.pipeline) the step over the stages' sub-meshes in a schedule's
                  order, each step one compiled call, the loop's steps run by the host;
  TablesExecutor  (tfpod.embedding.executor) OneMesh's step for a model with embedding
                  tables: their lookups before each compiled step and their sparse row
                  updates after it, on the devices that hold the rows, run by the host.

An executor answers, through `homes`, where each gradient lives and where its update runs
(optimizers.GradientHomes); `Update` answers how a gradient updates its weight, so a new
kind of update is written once there and serves every executor.

`Accumulation` is the accumulation every executor uses (t5x's
`accumulate_grads_microbatched`): a step's loss is `Task.loss_terms` over `Task.loss_counts`
of its whole batch, so the counts are summed over the microbatches first, each
microbatch's share of the loss (its sums over the whole step's counts, its aux term over
the microbatches) is differentiated in turn, and the gradients are added: the loss and
gradients of the unsplit batch (up to rounding; batch norm normalizes each microbatch). An
executor decides only the order of the shares.
"""

from __future__ import annotations

import abc
from typing import Callable, Collection, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tfpod import optimizers, partitioning, runtime
from tfpod.partitioning import Placement
from tfpod.task import LossTerms, Task

StepFn = Callable[[object], tuple]  # a packed step batch -> (loss, gradient norm), traced inside the loop
LoopFn = Callable[[object, int], tuple]  # (packed steps, num_steps) -> (losses, norms) [num_steps], host arrays


class Accumulation:
    """One step's gradient accumulation over its microbatches: the step's loss counts, each
    microbatch's share of the loss over them, and the sum of the gradients.

    Args:
      loss_counts: Task.loss_counts (what each loss sum is averaged over, from a batch).
      batches: the step's microbatches (on the mesh; traced), whose counts are summed first.
      sparse: the sources (by id()) whose gradients stay rows, tf.IndexedSlices, never
        densified: an embedding table's (tfpod.embedding.executor). Their rows are not added
        across microbatches: an executor with them runs one microbatch per step.
    """

    def __init__(self, loss_counts: Callable[[Mapping], Sequence[tf.Tensor]], batches: Sequence[Mapping],
                 sparse: Collection[int] = ()):
        self.microbatches = len(batches)
        self.counts = LossTerms.step_counts([loss_counts(b) for b in batches])
        self.sparse = frozenset(sparse)

    def share(self, terms: LossTerms) -> tf.Tensor:
        """A microbatch's share of the step's loss: its sums over the whole step's counts, plus
        its aux term / microbatches (terms without sums: a pipeline stage's aux terms alone)."""
        return terms.loss(self.counts if terms.sums else [], self.microbatches)

    def gradients(self, tape: tf.GradientTape, target, sources: Sequence, output_gradients=None) -> list:
        """The tape's gradients of `target` with respect to `sources`, dense (None where none
        reaches): DTensor has no layout propagation for ResourceScatterAdd, so an embedding's
        IndexedSlices are densified before they are added or applied; those of the `sparse`
        sources stay the rows they are."""
        sources = list(sources)
        grads = tape.gradient(target, sources, output_gradients=output_gradients)
        return [g if g is None or (id(v) in self.sparse and isinstance(g, tf.IndexedSlices))
                else tf.convert_to_tensor(g) for v, g in zip(sources, grads)]

    @staticmethod
    def add(total: Sequence, more: Sequence, indices: Sequence[int] | None = None) -> list:
        """Accumulation's one sum: `total` with each gradient of `more` added to its variable's
        entry (`indices[k]` for more[k]; all in order by default). An entry that is None takes
        the gradient as it comes; a gradient that is None adds nothing.

        Returns:
          A new list, len(total).
        """
        out = list(total)
        for j, g in zip(range(len(out)) if indices is None else indices, more):
            if g is not None:
                out[j] = g if out[j] is None else out[j] + g
        return out


class Executor(abc.ABC):
    """How a run's steps execute on its placement: chosen once per run, before the model is built.

    The Trainer calls, in order: `variable_stages` and `variable_layouts` (the build's stage
    assignment, and weights placed off the rules' layouts), `bind`
    (once the model, the update and the train state exist), then `make_loop` with its
    train step (`loss_and_gradients` then `Update.step` with `homes`), and per call of the
    loop `to_device`; evaluation compiles `eval_forward` and packs with `eval_to_device`.

    Args:
      task: the task.
      placement: the run's placement.
      microbatches: microbatches per step.
    """

    def __init__(self, task: Task, placement: Placement, microbatches: int = 1):
        self.task, self.placement, self.microbatches = task, placement, microbatches
        self.model = None
        self.variables: list = []

    def variable_stages(self, model) -> dict[int, int] | None:
        """{id of each (inner) weight: its stage} of the lazily built `model` (for
        partitioning.build_sharded); None: every weight on the placement's one mesh."""
        del model
        return None

    def variable_layouts(self, model, layouts: Mapping) -> dict:
        """{name: layout} of the weights of the lazily built `model` this executor places
        elsewhere than the rules' `layouts` (for partitioning.build_sharded); none by default."""
        del model, layouts
        return {}

    def bind(self, model, update: optimizers.Update, state) -> None:
        """Takes the built model and the update (its variables, in the update's order) and
        prepares what the steps need of them (`state`: the TrainState checkpoints hold)."""
        del state
        self.model, self.variables = model, list(update.variables)

    @property
    def homes(self) -> optimizers.GradientHomes:
        """Where each gradient lives and its update runs, for `Update.step`."""
        return optimizers.GradientHomes()

    @abc.abstractmethod
    def to_device(self, host_stack: Mapping[str, np.ndarray], num_steps: int):
        """This host's stacked batches [steps_per_loop, rows, ...] packed for the loop (`make_loop`)."""

    @abc.abstractmethod
    def loss_and_gradients(self, batch) -> tuple[tf.Tensor, list]:
        """One step's (loss, per variable its gradient) on a packed step batch, traced in the step."""

    @abc.abstractmethod
    def make_loop(self, step: StepFn, steps_per_loop: int) -> LoopFn:
        """The compiled loop of up to `steps_per_loop` calls of `step` (compiled with
        `Placement.compile`): fn(packed steps, num_steps) -> (losses, norms) as host arrays
        [num_steps]; `fn.experimental_get_tracing_count()` counts its traces."""

    @abc.abstractmethod
    def eval_to_device(self, host_batch: Mapping[str, np.ndarray]):
        """One host eval batch packed for `eval_forward`."""

    @abc.abstractmethod
    def eval_forward(self, batch) -> tuple[tf.Tensor, Mapping]:
        """(the model's outputs, training=False; the features the eval metric reads) of a packed eval batch."""


class OneMesh(Executor):
    """The step on the placement's one mesh: microbatches accumulated in a tf.while_loop
    (one microbatch's activations alive at a time; dropout draws each microbatch's own
    masks), and `steps_per_loop` steps in one compiled tf.while_loop over stacked batches.

    With microbatches > 1 each step's batch comes as [microbatches, rows / microbatches, ...]
    (`Placement.split_microbatches`: each microbatch split over the batch axis like the batch).

    Attributes:
      sparse: ids of the variables whose gradients stay rows (`Accumulation`'s `sparse`; a
        subclass sets them: tfpod.embedding.executor's tables).
    """

    sparse: frozenset = frozenset()

    def to_device(self, host_stack: Mapping[str, np.ndarray], num_steps: int) -> dict[str, tf.Tensor]:
        del num_steps  # the whole stack is packed; the loop runs num_steps of it
        axes = self.task.batch_axes()
        leading = 1
        if self.microbatches > 1:
            host_stack = self.placement.split_microbatches(host_stack, self.microbatches, axes, 1)
            leading = 2
        return self.placement.to_global(host_stack, axes, leading_dims=leading)

    def loss_and_gradients(self, batch: Mapping[str, tf.Tensor]) -> tuple[tf.Tensor, list]:
        task, model, variables, m = self.task, self.model, self.variables, self.microbatches

        def share(accumulation, part, index):
            """(this microbatch's share of the step's loss, its gradients)."""
            # (the gradient inside the microbatch's block too: a recomputed block (remat) runs its
            # forward again there, and must draw the same dropout masks and read the same weights)
            with partitioning.gathered_weights(), partitioning.microbatch(index):
                with tf.GradientTape() as tape:
                    loss = accumulation.share(task.loss_terms(model, part, True))
                return loss, accumulation.gradients(tape, loss, variables)

        if m == 1:
            return share(Accumulation(task.loss_counts, [batch], self.sparse), batch, None)
        take = lambda j: {k: tf.gather(v, j) for k, v in batch.items()}
        accumulation = Accumulation(task.loss_counts, [take(j) for j in range(m)], self.sparse)
        loss, grads = share(accumulation, take(0), 0)  # the first outside the loop: its gradients' layouts start it

        def body(j, loss, grads):
            part, more = share(accumulation, take(j), j)
            return j + 1, loss + part, Accumulation.add(grads, more)

        _, loss, grads = tf.while_loop(lambda j, *_: j < m, body, (tf.constant(1), loss, grads))
        return loss, grads

    def make_loop(self, step: StepFn, steps_per_loop: int) -> LoopFn:
        def train_loop(stacked, num_steps):
            def body(i, losses, norms):
                loss, norm = step({k: tf.gather(v, i) for k, v in stacked.items()})
                hot = tf.one_hot(i, steps_per_loop)
                return i + 1, losses + hot * tf.cast(loss, tf.float32), norms + hot * tf.cast(norm, tf.float32)

            zeros = tf.zeros([steps_per_loop])
            _, losses, norms = tf.while_loop(lambda i, *_: i < num_steps, body, (tf.constant(0), zeros, zeros))
            return losses, norms

        compiled = self.placement.compile(train_loop, self.microbatches)

        def run(stacked, num_steps: int):
            losses, norms = compiled(stacked, tf.constant(num_steps, tf.int32))
            return runtime.to_host(losses)[:num_steps], runtime.to_host(norms)[:num_steps]

        run.experimental_get_tracing_count = compiled.experimental_get_tracing_count
        return run

    def eval_to_device(self, host_batch: Mapping[str, np.ndarray]) -> dict[str, tf.Tensor]:
        return self.placement.to_global(host_batch, self.task.batch_axes())

    def eval_forward(self, batch: Mapping[str, tf.Tensor]) -> tuple[tf.Tensor, Mapping]:
        return self.model(self.task.model_inputs(batch), training=False), batch
