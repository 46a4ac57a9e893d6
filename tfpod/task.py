"""The Task contract: everything tfpod needs of a model to train, evaluate and serve it.

A task is a subclass of `Task` (one instance per model, registered in
tfpod.models.TASKS). Its class attributes name its configs and partitioning; its
methods build the model, describe and make its batches, compute its loss, read its
input and export it. The trainer, the evaluation, export and main.py call tasks only
through these methods.

To add a model: write models/<name>.py with the model (a tf_keras.Model whose
variables match `axis_rules`), its config dataclass, and a Task subclass; add its
instance to tfpod.models.TASKS; add gin/model/<name>.gin and gin/<name>_tiny.gin.
`tests/test_sharding.py` then checks its rules on every preset.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tfpod import evaluation
from tfpod.input.common import DataConfig, ShardInfo, TaskInput
from tfpod.partitioning import AxisRule, Placement


class Task(abc.ABC):
    """What a model gives tfpod.

    Class attributes:
      name: the model's name: `experiment.model`, and its config's gin name (`<name>.*`).
      config_class: the model's config dataclass.
      data_name: the gin name of its data config (tasks may share one: gpt, moe `lm_data`).
      data_config_class: the data config dataclass, a subclass of tfpod.input.common.DataConfig
        (the fields every data config has) whose `gin_name` is data_name.
      default_preset: the sharding preset when `sharding.preset` is unset.
      axis_rules: variable-path rules giving every variable its logical axes.
      eval_metric: the on-device eval metric (tfpod.evaluation.Metric).
      splits_image_rows: whether the model's convolutions split image rows over the mesh
        axis of the logical axis `height` (the `spatial` preset; tfpod.partitioning.spatial).

    Capabilities (class attributes; the defaults say "not offered", and the optional
    methods below have defaults to match):
      pipelines: `staged` cuts the model for pipeline stages (a `stage` mesh axis).
      recomputes: the model config has a `remat` switch (per-block recomputation), which
        the planner may set.
      skips_corrupt: the data config has `skip_corrupt` (skip unreadable records).
      lower_is_better: eval metrics a target is reached by going below (the rest: above).
      serves: `serving` exports the model (else --mode=export is refused in one line).
      sparse_tables: the model's tfpod.embedding tables are looked up on the devices that
        hold their rows and updated by rows (tfpod.embedding.executor.TablesExecutor runs
        its steps).
    """

    name: ClassVar[str]
    config_class: ClassVar[type]
    data_name: ClassVar[str]
    data_config_class: ClassVar[type]
    default_preset: ClassVar[str]
    axis_rules: ClassVar[tuple[AxisRule, ...]]
    eval_metric: ClassVar[evaluation.Metric]
    splits_image_rows: ClassVar[bool] = False
    pipelines: ClassVar[bool] = False
    recomputes: ClassVar[bool] = False
    skips_corrupt: ClassVar[bool] = False
    lower_is_better: ClassVar[frozenset] = frozenset({"loss", "perplexity"})
    serves: ClassVar[bool] = False
    sparse_tables: ClassVar[bool] = False
    # Set on the task tfpod.lora.adapt makes (its model has low-rank adapters): the LoraConfig
    # and the task it adapts.
    lora: ClassVar[Any] = None
    base_task: ClassVar[Any] = None

    # -- the model ------------------------------------------------------------

    @abc.abstractmethod
    def build(self, config) -> tf.keras.Model:
        """The (unbuilt) tf_keras model: called under a lazy-variable scope, then placed."""

    @abc.abstractmethod
    def input_signature(self, config) -> Mapping[str, tf.TensorSpec]:
        """The model's inputs (batch dimension None), to build it without data."""

    @abc.abstractmethod
    def flops_per_token(self, config) -> float:
        """Model FLOPs per trained token (per example when `tokens_per_example` is None)."""

    def weight_flops_per_token(self, config) -> float | None:
        """The part of flops_per_token that is weights' matmuls: 6 per weight a token
        multiplies (2 forward, 2 for its input's gradient, 2 for its own). None: not known."""
        del config
        return None

    def step_flops_per_token(self, config, variables) -> float:
        """The model FLOPs a training step computes per token (what MFU and the planner count),
        given the model's `variables` (each with .name and .shape): flops_per_token, but a
        tfpod.lora task's frozen weights get no gradient of their own."""
        del variables
        return self.flops_per_token(config)

    def tokens_per_example(self, config) -> int | None:
        """Tokens per example, for tokens/s and MFU (None: the task counts examples)."""
        return None

    def plan_profile(self, config, outputs) -> "Profile | None":
        """What a training step keeps and moves per example, in logical axes
        (tfpod.plan.profile), for --mode=plan. `outputs`: (layer, output shape) of every
        leaf layer the model's lazy build called (`tfpod.plan.lazy.recorded_build`).
        None: the task cannot be planned (the default)."""
        del config, outputs
        return None

    # -- batches --------------------------------------------------------------

    @abc.abstractmethod
    def batch_axes(self) -> Mapping[str, tuple]:
        """Logical axes of every batch feature; the first axis is the batch."""

    @abc.abstractmethod
    def model_inputs(self, batch: Mapping[str, tf.Tensor]):
        """The part of a batch the model is called on."""

    @abc.abstractmethod
    def synthetic_batch(self, config, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """A random batch of the task's shapes (train.synthetic_data=True)."""

    @abc.abstractmethod
    def make_input(self, data_config, model_config, shard: ShardInfo, seed: int) -> TaskInput:
        """This host's input: its training and eval datasets (prepares demo data on first use)."""

    # -- training and evaluation ----------------------------------------------

    @abc.abstractmethod
    def loss_terms(self, model, batch: Mapping[str, tf.Tensor], training: bool) -> "LossTerms":
        """The loss of one global batch (or one microbatch of it) as sums over its rows,
        inside the compiled step: each term of `sums` is averaged over its count in
        `loss_counts` of the whole step's batch, so any split into microbatches gives the
        loss of the unsplit batch (tfpod.executor.Accumulation, for every executor)."""

    @abc.abstractmethod
    def loss_counts(self, batch: Mapping[str, tf.Tensor]) -> list[tf.Tensor]:
        """What each of `loss_terms`' sums is averaged over in `batch` (float32 scalars, one per
        term: e.g. [the weighted tokens]; BERT: [real predictions, examples]). From the batch
        alone: the trainer sums them over the microbatches before any forward pass."""

    def loss_and_metrics(self, model, batch: Mapping[str, tf.Tensor], training: bool) -> tuple[tf.Tensor, dict]:
        """(scalar float32 loss, {name: scalar}) of one whole batch: `loss_terms` averaged over
        `loss_counts`."""
        terms = self.loss_terms(model, batch, training)
        return terms.loss(self.loss_counts(batch)), dict(terms.metrics)

    def host_eval_metrics(self, context: "EvalContext", host_batches: Sequence[Mapping[str, np.ndarray]]) -> dict:
        """Metrics computed on the hosts after the on-device ones (the Transformer's BLEU). Default: none."""
        del context, host_batches
        return {}

    def staged(self, model) -> "StagedModel | None":
        """The model cut into pipeline pieces (with `pipelines`; a `stage` mesh axis);
        None: the task does not pipeline (the default)."""
        del model
        return None

    # -- serving --------------------------------------------------------------

    def serving(self, model, config, data_config) -> tuple[tf.Module, dict] | None:
        """(module holding the single-device model, {signature name: concrete function}),
        with `serves`; None: the task trains and evaluates but does not export (the default)."""
        del model, config, data_config
        return None


@dataclasses.dataclass(frozen=True)
class LossTerms:
    """A (micro)batch's loss as `Task.loss_terms` gives it.

    Attributes:
      sums: each loss term summed over the batch's rows (e.g. [the weighted token losses];
        BERT: [masked-LM sum, next-sentence sum]), float32 scalars.
      aux: a term that is already a mean, its weight included (MoE load balancing, SSD's
        weight decay), or None; a microbatch adds its share, aux / microbatches.
      metrics: {name: float32 scalar} of this batch (for tests and tools; the step logs the loss).
    """

    sums: Sequence[tf.Tensor]
    aux: tf.Tensor | None = None
    metrics: Mapping[str, tf.Tensor] = dataclasses.field(default_factory=dict)

    @staticmethod
    def step_counts(microbatch_counts: Sequence[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
        """The whole step's count of each term: the microbatches' `Task.loss_counts` summed term by term."""
        return [tf.add_n(list(term)) for term in zip(*microbatch_counts)]

    def loss(self, counts: Sequence[tf.Tensor], microbatches: int = 1) -> tf.Tensor:
        """sum over the terms of sum / max(count, 1), plus aux / microbatches: this batch's share of
        the step's loss, where `counts` are the whole step's (`Task.loss_counts`, summed)."""
        if len(counts) != len(self.sums):
            raise ValueError(f"{len(self.sums)} loss sums but {len(counts)} counts")
        parts = [tf.cast(s, tf.float32) / tf.maximum(tf.cast(c, tf.float32), 1.0) for s, c in zip(self.sums, counts)]
        if self.aux is not None:
            parts.append(tf.cast(self.aux, tf.float32) / microbatches)
        return tf.add_n(parts)


@dataclasses.dataclass(frozen=True)
class EvalContext:
    """What a task's `host_eval_metrics` may use: the trained model on the mesh, and this host's place.

    Attributes:
      model: the model (its variables on the mesh).
      model_config: the task's model config.
      placement: the mesh, rules and data layout.
      host_rows: rows of a full host batch.
      host_id, num_hosts: this host's place.
      data_config: the task's data config (None when the caller has none, e.g. a benchmark).
    """

    model: Any
    model_config: Any
    placement: Placement
    host_rows: int
    host_id: int
    num_hosts: int
    data_config: Any = None

    @property
    def is_chief(self) -> bool:
        return self.host_id == 0

    def run_padded(self, step: Callable[[dict], tf.Tensor], host_batches: Sequence[Mapping[str, np.ndarray]],
                   feature_axes: Mapping[str, Sequence[str | None]], padding: Mapping[str, np.ndarray] | None = None
                   ) -> list[np.ndarray]:
        """`step` over this host's batches on the mesh, every host the same number of calls.

        Each batch is padded to host_rows rows; a host with fewer batches runs padding
        batches (`padding`, default zeros). Returns this host's rows of each real batch's
        output (the output's first dimension split like the batch), padding rows removed.
        """
        sizes = [len(next(iter(b.values()))) for b in host_batches]
        outputs = evaluation.run_padded(lambda b: self.placement.to_host(step(b)), host_batches, self.host_rows,
                                        lambda b: self.placement.to_global(b, feature_axes), self.placement.mesh,
                                        padding)
        return [out[:n] for out, n in zip(outputs, sizes)]  # the real batches' rows; padding calls dropped

    def host_sum(self, values) -> np.ndarray:
        """The sum over every host of a per-host vector (a collective: every host must call it)."""
        return evaluation.host_sum(values, self.placement.mesh)


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """A model cut for pipeline stages (`Task.staged`): what runs before, in and after its blocks.

    The blocks divide into contiguous, equal stages; `first_layers`' weights live on the
    first stage, `last_layers`' on the last (a weight read on another stage, as a tied
    output layer reads the embedding, is copied there, and its gradient back).

    Attributes:
      first: (batch, training) -> x, the first block's input [batch, ...] (first stage).
      context: batch -> what every block reads besides x (e.g. the attention mask), made
        on each stage from the batch.
      blocks: the blocks, in order.
      block: (block, x, context, training) -> (x, aux loss): one block; aux is this
        block's own term of the loss (e.g. MoE load balancing, already weighted) or None.
      outputs: (x, batch) -> the model's outputs, as `Task.eval_metric` reads them (last stage).
      loss_sums: (x, batch, training) -> a microbatch's `LossTerms.sums` from the last
        block's output, without the blocks' aux terms (last stage); each is averaged over
        its count in `Task.loss_counts` of the whole step, the aux terms over the microbatches.
      activation_axes: logical axes of x between blocks.
      first_layers, last_layers: the layers whose weights live on the first / last stage.
    """

    first: Callable
    context: Callable
    blocks: Sequence
    block: Callable
    outputs: Callable
    loss_sums: Callable
    activation_axes: tuple
    first_layers: Sequence
    last_layers: Sequence


def check_task(task: Task) -> None:
    """Raises TypeError when a registered task lacks a class attribute of the contract, or
    declares a capability its configs do not have the switch of."""
    for attr in ("name", "config_class", "data_name", "data_config_class", "default_preset", "axis_rules",
                 "eval_metric"):
        if not hasattr(type(task), attr):
            raise TypeError(f"task {type(task).__name__} does not set Task.{attr}")
    if not (isinstance(task.data_config_class, type) and issubclass(task.data_config_class, DataConfig)):
        raise TypeError(f"task {type(task).__name__}: its data_config_class {task.data_config_class!r} is not a "
                        "dataclass subclassing tfpod.input.common.DataConfig (the fields every data config has)")
    if task.data_config_class.gin_name != task.data_name:
        raise TypeError(f"task {type(task).__name__}: {task.data_config_class.__name__}.gin_name is "
                        f"{task.data_config_class.gin_name!r}, not its data_name {task.data_name!r}")
    for capability, cls, field in (("recomputes", task.config_class, "remat"),
                                   ("skips_corrupt", task.data_config_class, "skip_corrupt")):
        if getattr(task, capability) and field not in {f.name for f in dataclasses.fields(cls)}:
            raise TypeError(f"task {type(task).__name__} declares Task.{capability} but {cls.__name__} has no "
                            f"`{field}` field")

