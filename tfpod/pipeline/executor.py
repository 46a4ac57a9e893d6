"""The pipeline's executor (tfpod.executor.Executor) and eval forward: a StagedModel run over
stage sub-meshes.

The trainer's compiled step calls `loss_and_gradients` and ends it in the one update every
model's step ends in (tfpod.optimizers.Update.step, with the stages' `homes`: norm,
clipping, finiteness, each stage updating its own weights). Every (stage, microbatch)
forward runs under its own GradientTape on its stage's mesh; its output is copied to the
next stage (`stages.to_mesh`), and its backward is that tape's gradient given the next
stage's input gradient, so the backward reuses the forward's activations. DTensor splits the
function into one program per mesh that run concurrently and exchange the copies, so a stage
computes while the others do; what orders a stage's own actions is the schedule: each
action's entry tensor (a forward's input, a backward's incoming gradient) waits on the
previous action of that stage (`after`: a data dependency), so under 1F1B the next forward
cannot start, and allocate, before the backward that frees a microbatch. Gradients
accumulate over the microbatches as on one mesh (tfpod.executor.Accumulation), in the
schedule's order.

A pipelined step spans the stages' meshes, which DTensor cannot carry through a while
loop ("CopyToMesh acrosses Clusters should have been lowered to DTensorSend/DTensorRecv");
unrolling the steps in the trace instead compiles n times as long for no faster step
(docs/benchmarks.md, "Pipeline steps per call"), so each step is one compiled call, and
the loop over a call's steps runs on the host, fetching the losses once at its end
(`make_loop`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf

from tfpod import UserError, compat, optimizers, runtime
from tfpod.executor import Accumulation, Executor, LoopFn, StepFn
from tfpod.partitioning import Placement, gathered_weights, layout_for, shard, stages
from tfpod.partitioning.dropout import microbatch
from tfpod.pipeline import schedules
from tfpod.pipeline.homes import StageHomes
from tfpod.task import LossTerms, StagedModel, Task


def check_pipelines(task, able: str = "") -> None:
    """One UserError line when `task` declares no stages (Task.pipelines); `able` names the
    models that do (the caller's registry: this package sits below the models)."""
    if not task.pipelines:
        raise UserError(f"model {task.name!r} does not run in pipeline stages (a `stage` mesh axis): pipelines "
                        f"are for {able or 'models whose Task declares stages'}; drop the stage axis "
                        f"(train.microbatches alone accumulates gradients for every model)")


def staged_model(task, model) -> StagedModel:
    """The task's StagedModel of `model`; a task that does not pipeline is one UserError."""
    check_pipelines(task)
    return task.staged(model)


def stage_blocks(staged: StagedModel, num_stages: int) -> list[list]:
    """Each stage's blocks: contiguous runs of `stages.stage_sizes`.

    Raises:
      UserError: fewer blocks than stages.
    """
    ends = np.cumsum([0] + stages.stage_sizes(len(staged.blocks), num_stages))
    return [list(staged.blocks[ends[s]:ends[s + 1]]) for s in range(num_stages)]


def variable_stages(staged: StagedModel, num_stages: int) -> dict[int, int]:
    """{id of each (inner) weight: its stage}: first_layers' on the first, the blocks'
    on theirs (`stage_blocks`), last_layers' on the last."""
    owner = {}

    def assign(layers, stage):
        for layer in layers:
            for w in layer.weights:
                owner.setdefault(id(compat.inner_variable(w)), stage)

    assign(staged.first_layers, 0)
    for s, blocks in enumerate(stage_blocks(staged, num_stages)):
        assign(blocks, s)
    assign(staged.last_layers, num_stages - 1)
    return owner


def after(x: tf.Tensor, previous: Sequence[tf.Tensor]) -> tf.Tensor:
    """x, made to wait for `previous` (what the stage's last action produced) by a data
    dependency: x + 0 * sum(the smallest of them). DTensor's passes do not keep control
    edges (with `tf.control_dependencies` 1F1B held as many activations as GPipe); a
    step that is NaN anyway becomes NaN here too, and is skipped as it would be."""
    if not previous:
        return x
    smallest = min(previous, key=lambda t: t.shape.num_elements() or 0)
    gate = tf.reduce_sum(tf.cast(smallest, tf.float32)) * 0.0
    return x + tf.cast(gate, x.dtype)


class Pipeline(Executor):
    """The step over the placement's stages (tfpod.executor.Executor): the task's StagedModel,
    each weight on its stage's mesh, a schedule's forwards and backwards over the
    microbatches, the eval forward through the stages.

    Args:
      task: the task (it declares stages: Task.pipelines).
      placement: the mesh's stages.
      microbatches: microbatches per step.
      schedule: "gpipe" or "1f1b".
    """

    def __init__(self, task: Task, placement: Placement, microbatches: int = 1, schedule: str = "gpipe"):
        super().__init__(task, placement, microbatches)
        self.num_stages = p = placement.num_stages
        self.meshes = [placement.stage(s).mesh for s in range(p)]
        self.order = [(s, action) for _, s, action in schedules.timeline(schedules.schedule(schedule, p, microbatches))]
        self.staged, self.stage_blocks, self.homes_of = None, None, []

    def variable_stages(self, model) -> dict[int, int]:
        return variable_stages(staged_model(self.task, model), self.num_stages)

    def bind(self, model, update: optimizers.Update, state) -> None:
        """Makes every weight, and the optimizer's step counter and hyperparameters (on the first
        stage), readable on every stage, and checkpoints write and read the other stages'
        state through the first (TrainState.save_through)."""
        super().bind(model, update, state)
        for v in model.variables + update.scalars():
            stages.follow_active_mesh(v)
        state.save_through(model.variables + optimizers.slot_variables(update.optimizer) + update.shadow_list(),
                           self.placement.mesh)
        self.staged = staged_model(self.task, model)
        self.stage_blocks = stage_blocks(self.staged, self.num_stages)
        self.homes_of = [self.home(v) for v in self.variables]

    @property
    def homes(self) -> StageHomes:
        return StageHomes(self.placement, self.homes_of)

    def home(self, variable) -> int:
        """The stage a variable lives on."""
        return stages.stage_index(compat.inner_variable(variable).layout, self.meshes)

    def receive(self, x: tf.Tensor, source: int, s: int) -> tf.Tensor:
        """An activation (or its gradient) of stage `source` copied to stage s, laid out there."""
        return stages.to_mesh(x, self.meshes[source],
                              layout_for(self.staged.activation_axes, self.placement.table, self.meshes[s]))

    def run_blocks(self, s: int, x: tf.Tensor, batch: Mapping[str, tf.Tensor], training: bool) -> tuple:
        """Stage s's blocks on x (inside its activation context): (x, their aux loss terms)."""
        context = self.staged.context(batch)
        aux = []
        for block in self.stage_blocks[s]:
            x, a = self.staged.block(block, x, context, training)
            x = shard(x, self.staged.activation_axes)
            if a is not None:
                aux.append(tf.cast(a, tf.float32))
        return x, aux

    def scalar_on(self, x: tf.Tensor, source: int, s: int) -> tf.Tensor:
        """A scalar on stage `source` copied to stage s."""
        return stages.scalar_to(x, self.meshes[source], self.meshes[s])

    # -- host side ----------------------------------------------------------------

    def _pack(self, host_batch: Mapping[str, np.ndarray]) -> list[dict]:
        """This host's batch packed on every stage's mesh (each stage reads the features it needs)."""
        axes = self.task.batch_axes()
        return [self.placement.stage(s).to_global(host_batch, axes) for s in range(self.num_stages)]

    def to_stages(self, host_batch: Mapping[str, np.ndarray]) -> list[list[dict]]:
        """One step's batch for `loss_and_gradients`: [stage][microbatch], each microbatch packed
        on every stage's mesh."""
        split = self.placement.split_microbatches(host_batch, self.microbatches, self.task.batch_axes())
        # Each microbatch packed on its own (slicing one [M, rows, ...] DTensor lost the
        # layout of features with unsharded trailing dimensions, e.g. BERT's predictions).
        packed = [self._pack({k: v[i] for k, v in split.items()}) for i in range(self.microbatches)]
        return [[packed[i][s] for i in range(self.microbatches)] for s in range(self.num_stages)]

    def to_device(self, host_stack: Mapping[str, np.ndarray], num_steps: int) -> list[list[list[dict]]]:
        """The first `num_steps` steps of this host's stack, each packed by `to_stages`."""
        return [self.to_stages({k: v[n] for k, v in host_stack.items()}) for n in range(num_steps)]

    def make_loop(self, step: StepFn, steps_per_loop: int) -> LoopFn:
        """Each step one compiled call; the host runs the call's steps back to back and fetches
        their losses once, at the end (see the module docstring)."""
        compiled = self.placement.compile(step, self.microbatches)

        def host_loop(steps, num_steps: int):
            results = [compiled(batch) for batch in steps[:num_steps]]
            losses, norms = np.zeros([steps_per_loop], np.float32), np.zeros([steps_per_loop], np.float32)
            for i, (loss, norm) in enumerate(results):
                losses[i], norms[i] = runtime.to_host(loss), runtime.to_host(norm)
            return losses[:num_steps], norms[:num_steps]

        host_loop.experimental_get_tracing_count = compiled.experimental_get_tracing_count
        return host_loop

    # -- the compiled step ----------------------------------------------------------

    def loss_and_gradients(self, stage_batches: Sequence[Sequence[Mapping[str, tf.Tensor]]]) -> tuple:
        """The schedule's forwards and backwards over stage_batches[stage][microbatch]: (the
        step's loss on the last stage, per variable its gradient on its stage)."""
        grads, objectives = self._forwards_and_backwards(stage_batches)
        return self._loss(objectives), grads

    def _forwards_and_backwards(self, stage_batches: Sequence[Sequence[Mapping[str, tf.Tensor]]]) -> tuple[list, dict]:
        """The schedule's actions on stage_batches[stage][microbatch]: (per variable its gradient summed over the
        microbatches, {(stage, microbatch): that forward's own share of the loss or None})."""
        staged, p, m = self.staged, self.num_stages, self.microbatches
        last = p - 1
        with self.placement.stage_activations(last):
            accumulation = Accumulation(self.task.loss_counts, [stage_batches[last][i] for i in range(m)])
        tapes, inputs, outputs, objectives, input_grads = {}, {}, {}, {}, {}
        grads = [None] * len(self.variables)
        previous = [[] for _ in range(p)]  # what the stage's last action produced
        for s, (kind, i) in self.order:
            with self.placement.stage_activations(s), microbatch(i):
                if kind == "F":
                    x_in = None if s == 0 else after(self.receive(outputs[(s - 1, i)], s - 1, s), previous[s])
                    batch = stage_batches[s][i]
                    tape = tf.GradientTape()
                    with tape, gathered_weights():  # the `2d` preset's weights gathered where the blocks use them
                        if x_in is not None:
                            tape.watch(x_in)
                        x = after(staged.first(batch, True), previous[s]) if s == 0 else x_in
                        x, aux = self.run_blocks(s, x, batch, True)
                        objective = accumulation.share(LossTerms([], aux=tf.add_n(aux))) if aux else None
                        if s == last:
                            head = accumulation.share(LossTerms(staged.loss_sums(x, batch, True)))
                            objective = head if objective is None else objective + head
                    tapes[(s, i)], inputs[(s, i)], outputs[(s, i)], objectives[(s, i)] = tape, x_in, x, objective
                    previous[s] = [x] + ([objective] if objective is not None else [])
                else:
                    dy = None if s == last else after(self.receive(input_grads[(s + 1, i)], s + 1, s), previous[s])
                    objective = objectives[(s, i)]
                    one = None if objective is None else after(tf.ones_like(objective), previous[s])
                    targets = ([outputs[(s, i)]] if dy is not None else []) + ([objective] if one is not None else [])
                    seeds = ([dy] if dy is not None else []) + ([one] if one is not None else [])
                    tape = tapes.pop((s, i))
                    watched = {id(compat.inner_variable(w)) for w in tape.watched_variables()}
                    used = [j for j, v in enumerate(self.variables) if id(compat.inner_variable(v)) in watched]
                    sources = ([inputs[(s, i)]] if s > 0 else []) + [self.variables[j] for j in used]
                    result = accumulation.gradients(tape, targets, sources, output_gradients=seeds)
                    if s > 0:
                        input_grads[(s, i)], result = result[0], result[1:]
                    grads = accumulation.add(grads, result, used)
                    own = [grads[j] for j, g in zip(used, result) if g is not None and self.homes_of[j] == s]
                    previous[s] = ([input_grads[(s, i)]] if s > 0 else []) + own
                    inputs.pop((s, i), None)

        missing = [v.name for v, g in zip(self.variables, grads) if g is None]
        if missing:
            raise ValueError(f"pipeline: no gradient reaches {missing[:3]}")
        return grads, objectives

    def _loss(self, objectives: Mapping) -> tf.Tensor:
        """The step's loss, on the last stage: every (stage, microbatch) forward's own term."""
        losses = []
        for s in range(self.num_stages):
            with self.placement.stage_activations(s):
                parts = [o for (t, _), o in objectives.items() if t == s and o is not None]
                if parts:
                    losses.append(self.scalar_on(tf.add_n(parts), s, self.num_stages - 1))
        return tf.add_n(losses)

    # -- evaluation ---------------------------------------------------------------

    def eval_to_device(self, host_batch: Mapping[str, np.ndarray]) -> list[dict]:
        return self._pack(host_batch)

    def eval_forward(self, stage_batches: Sequence[Mapping[str, tf.Tensor]]) -> tuple[tf.Tensor, Mapping]:
        """(the model's outputs (StagedModel.outputs, on the last stage) of one batch, no
        microbatches; the last stage's batch, which the metric reads)."""
        staged, last = self.staged, self.num_stages - 1
        x = None
        for s in range(self.num_stages):
            with self.placement.stage_activations(s):
                batch = stage_batches[s]
                x = staged.first(batch, False) if s == 0 else self.receive(x, s - 1, s)
                x, _ = self.run_blocks(s, x, batch, False)
        with self.placement.stage_activations(last):
            return staged.outputs(x, stage_batches[last]), stage_batches[last]
