"""Optimizers and learning-rate schedules from tf-models-official, on DTensor.

Model Garden's optimizers (AdamWeightDecay, LAMB, LARS) create their slots with plain
`tf.Variable`s. Here each slot is created inside a variable creator that makes it a
DVariable laid out like the weight it belongs to (or, for weight-update sharding, in
any layout a caller chooses), so the update runs shard-locally on every device.

`Update` applies gradients. With an update axis (weight-update sharding, the MLPerf
TPU-pod technique, ZeRO-style) a weight replicated over that axis is updated in
shards: its gradient is relaid out to the sharded layout (DTensor's all-reduce plus
split, a reduce-scatter), the optimizer updates a sharded working copy of the weight
with sharded slots, and the result is relaid out back to the weight's own layout (an
all-gather). The working copy is refreshed from the weight each step (a local slice),
so checkpoints hold only the weight and its slots, keyed as without sharding.

`Update.step` is the one update every executor's step ends in (tfpod.executor): the
norm, clipping, and the update only when finite. Where each gradient lives and its update
runs is the executor's answer (`GradientHomes`: all on one mesh; a pipeline's stages hand
their own); how a gradient scales and updates its weight is `Update`'s, for every executor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor
from official.modeling.optimization import lamb, lars, legacy_adamw, lr_schedule

from tfpod import UserError, compat, fused, partitioning

OPTIMIZERS = ("adamw", "lamb", "lars", "sgd", "adagrad")
DECAYS = ("cosine", "linear", "polynomial", "rsqrt", "piecewise", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and schedule. Attributes map 1:1 to gin `optimizer.<name>`.

    Attributes:
      name: adamw (Model Garden AdamWeightDecay), lamb, lars, sgd (momentum), or adagrad
        (tf_keras's; MLPerf DLRM's optimizer; embedding tables update sparsely with any of
        sgd, adagrad and adamw, tfpod.embedding).
      learning_rate: peak learning rate, reached at the end of warmup.
      warmup_steps: linear warmup from 0 (Model Garden LinearWarmup).
      decay: schedule after warmup: cosine, linear, polynomial, rsqrt (learning_rate *
        sqrt(warmup_steps / step), the Transformer's; ignores decay_steps and
        end_learning_rate_ratio), piecewise (steps: learning_rate times
        piecewise_ratios[i] after step piecewise_boundaries[i], MLPerf SSD's x0.1 and
        x0.01; ignores decay_steps and end_learning_rate_ratio), or constant.
      decay_steps: steps of the decay (None: the run's train.steps).
      end_learning_rate_ratio: final learning rate as a fraction of the peak.
      power: exponent of the polynomial decay.
      piecewise_boundaries: piecewise: the (global, increasing) steps where the rate changes.
      piecewise_ratios: piecewise: the rate after each boundary, as a fraction of learning_rate.
      weight_decay: decoupled weight decay (adamw, lamb, lars; sgd has none: must be 0).
      beta_1, beta_2, epsilon: Adam/LAMB moments.
      momentum: lars/sgd momentum.
      exclude_from_weight_decay: variable-name substrings with no weight decay.
      clip_norm: global gradient-norm clipping (0 or None: off).
      initial_accumulator: adagrad's initial accumulator value (tf_keras: 0.1; PyTorch: 0).
    """

    name: str = "adamw"
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    decay: str = "cosine"
    decay_steps: int | None = None
    end_learning_rate_ratio: float = 0.1
    power: float = 1.0
    piecewise_boundaries: Sequence[int] = ()
    piecewise_ratios: Sequence[float] = ()
    weight_decay: float = 0.01
    beta_1: float = 0.9
    beta_2: float = 0.95
    epsilon: float = 1e-8
    momentum: float = 0.9
    exclude_from_weight_decay: Sequence[str] = ("layer_norm", "final_norm", "bias", "embeddings")
    clip_norm: float | None = 1.0
    initial_accumulator: float = 0.1

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise UserError(f"optimizer.name={self.name!r} is not known: use one of {', '.join(OPTIMIZERS)}")
        if self.decay not in DECAYS:
            raise UserError(f"optimizer.decay={self.decay!r} is not known: use one of {', '.join(DECAYS)}")
        if self.learning_rate <= 0:
            raise UserError(f"optimizer.learning_rate={self.learning_rate} must be positive")
        if self.warmup_steps < 0:
            raise UserError(f"optimizer.warmup_steps={self.warmup_steps} must be >= 0")
        if self.name in ("sgd", "adagrad") and self.weight_decay:
            raise UserError(f"optimizer.weight_decay={self.weight_decay}: optimizer.name={self.name!r} applies no weight "
                            "decay; set optimizer.weight_decay=0 (an L2 term belongs in the model's loss, e.g. "
                            "ssd.weight_decay) or use lars or adamw")
        bounds, ratios = list(self.piecewise_boundaries), list(self.piecewise_ratios)
        if self.decay == "piecewise" and (not bounds or len(bounds) != len(ratios)
                                          or any(b >= c for b, c in zip(bounds, bounds[1:]))
                                          or bounds[0] <= self.warmup_steps):
            raise UserError(f"optimizer.decay='piecewise' needs increasing optimizer.piecewise_boundaries (steps, after "
                            f"warmup_steps={self.warmup_steps}) and one optimizer.piecewise_ratios entry per boundary; "
                            f"got {tuple(bounds)} and {tuple(ratios)}")


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int):
    """Warmup then decay, from Model Garden's lr_schedule (a Keras LearningRateSchedule)."""
    decay_steps = max(1, (cfg.decay_steps or total_steps) - cfg.warmup_steps)
    end = cfg.learning_rate * cfg.end_learning_rate_ratio
    if cfg.decay == "cosine":
        schedule = lr_schedule.CosineDecayWithOffset(
            initial_learning_rate=cfg.learning_rate,
            decay_steps=decay_steps,
            alpha=cfg.end_learning_rate_ratio,
            offset=cfg.warmup_steps,
        )
    elif cfg.decay in ("linear", "polynomial"):
        schedule = lr_schedule.PolynomialDecayWithOffset(
            initial_learning_rate=cfg.learning_rate,
            decay_steps=decay_steps,
            end_learning_rate=end,
            power=1.0 if cfg.decay == "linear" else cfg.power,
            offset=cfg.warmup_steps,
        )
    elif cfg.decay == "piecewise":  # the step passed is the global step (no offset)
        schedule = lr_schedule.PiecewiseConstantDecayWithOffset(
            boundaries=list(cfg.piecewise_boundaries),
            values=[cfg.learning_rate] + [cfg.learning_rate * r for r in cfg.piecewise_ratios])
    elif cfg.decay == "rsqrt":  # Model Garden's power schedule with power -0.5, peak at the warmup's end
        schedule = lr_schedule.DirectPowerDecay(
            initial_learning_rate=cfg.learning_rate * max(cfg.warmup_steps, 1) ** 0.5, power=-0.5)
    else:
        schedule = cfg.learning_rate
    if cfg.warmup_steps:
        schedule = lr_schedule.LinearWarmup(
            after_warmup_lr_sched=schedule, warmup_steps=cfg.warmup_steps, warmup_learning_rate=0.0
        )
    return schedule


class FusedAdamWeightDecay(legacy_adamw.AdamWeightDecay):
    """Model Garden's AdamWeightDecay, its update written as TensorFlow ops (one XLA loop
    per weight with `TFPOD_XLA_FUSION=1`).

    The same arithmetic as Model Garden's: the decoupled decay
    w -= (lr * w) * weight_decay_rate, then TensorFlow's ResourceApplyAdam (alpha = lr *
    sqrt(1 - beta2^t) / (1 - beta1^t); m += (g - m) * (1 - beta1); v += (g^2 - v) *
    (1 - beta2); w -= m * alpha / (sqrt(v) + epsilon)), written as TensorFlow ops in
    one `fused.scope`. DTensor decomposes the ResourceApplyAdam kernel into about fifteen
    separate elementwise passes anyway; with XLA
    marks the update reads and writes each weight, slot and gradient once.
    """

    def _resource_apply_dense(self, grad, var, apply_state=None):
        lr, c = compat.adam_coefficients(self, var, apply_state)
        m, v = self.get_slot(var, "m"), self.get_slot(var, "v")
        with fused.scope():
            w = var.read_value()
            if compat.uses_weight_decay(self, var.name):
                w = w - lr * w * c["weight_decay_rate"]
            alpha = lr * tf.sqrt(1.0 - c["beta_2_power"]) / (1.0 - c["beta_1_power"])
            m_new = m + (grad - m) * (1.0 - c["beta_1_t"])
            v_new = v + (tf.square(grad) - v) * (1.0 - c["beta_2_t"])
            w_new = w - (m_new * alpha) / (tf.sqrt(v_new) + c["epsilon"])
            return tf.group(m.assign(m_new, read_value=False), v.assign(v_new, read_value=False),
                            var.assign(w_new, read_value=False))


class _UpdateInOneCluster:
    """Mixin: the optimizer's own per-weight update (its TensorFlow ops) in one `fused.scope`,
    one XLA cluster per weight with `TFPOD_XLA_FUSION=1`."""

    def _resource_apply_dense(self, *args, **kwargs):
        with fused.scope():
            return super()._resource_apply_dense(*args, **kwargs)


class FusedLAMB(_UpdateInOneCluster, lamb.LAMB):
    """Model Garden's LAMB, each weight's update one XLA cluster with `TFPOD_XLA_FUSION=1`."""


class FusedLARS(_UpdateInOneCluster, lars.LARS):
    """Model Garden's LARS, each weight's update one XLA cluster with `TFPOD_XLA_FUSION=1`."""


def build_optimizer(cfg: OptimizerConfig, total_steps: int, fused_update: bool = True):
    """A Model Garden (legacy tf_keras) optimizer with its schedule.

    Args:
      cfg: the optimizer config.
      total_steps: the run's steps (the decay's default length).
      fused_update: AdamW, LAMB and LARS update each weight in one fused loop (the
        Fused* classes, same arithmetic); False gives Model Garden's own classes as
        they are (the benchmarks' baselines). AdamW's own gradient clipping (Model
        Garden clips at 1.0 unless told otherwise) is off in the fused class: the train
        step clips at cfg.clip_norm, and a second clip would ignore that setting.
    """
    lr = learning_rate_schedule(cfg, total_steps)
    exclude = list(cfg.exclude_from_weight_decay)
    if cfg.name == "adamw":
        adamw = dict(learning_rate=lr, weight_decay_rate=cfg.weight_decay, beta_1=cfg.beta_1, beta_2=cfg.beta_2,
                     epsilon=cfg.epsilon, exclude_from_weight_decay=exclude)
        if not fused_update:
            return legacy_adamw.AdamWeightDecay(**adamw)
        return FusedAdamWeightDecay(**adamw, gradient_clip_norm=0.0, name="AdamWeightDecay")
    if cfg.name == "lamb":
        return (FusedLAMB if fused_update else lamb.LAMB)(
            learning_rate=lr,
            beta_1=cfg.beta_1,
            beta_2=cfg.beta_2,
            epsilon=cfg.epsilon,
            weight_decay_rate=cfg.weight_decay,
            exclude_from_weight_decay=exclude,
            exclude_from_layer_adaptation=exclude,
            name="LAMB",
        )
    if cfg.name == "lars":
        return (FusedLARS if fused_update else lars.LARS)(
            learning_rate=lr,
            momentum=cfg.momentum,
            weight_decay_rate=cfg.weight_decay,
            exclude_from_weight_decay=exclude,
            exclude_from_layer_adaptation=exclude,
            name="LARS",
        )
    if cfg.name == "adagrad":
        return tf_keras.optimizers.legacy.Adagrad(learning_rate=lr, initial_accumulator_value=cfg.initial_accumulator,
                                                  epsilon=cfg.epsilon)
    return tf_keras.optimizers.legacy.SGD(learning_rate=lr, momentum=cfg.momentum)


def _to_mesh(value: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
    """A host tensor as a DTensor of `layout` (computed replicated, then relaid out)."""
    replicated = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(layout.mesh, value.shape.rank))
    return dtensor.relayout(replicated, layout)


@contextlib.contextmanager
def dvariable_scope(layout_fn: Callable[[tf.TensorShape], dtensor.Layout]):
    """Every variable created inside becomes a DVariable with layout_fn(shape)."""

    def creator(next_creator, **kwargs):
        del next_creator
        init = kwargs.pop("initial_value")
        # On the host: Keras computes a slot's zeros where its weight lives, the DTensor
        # device, and there, once another mesh had run in this process (a pipeline's stage
        # meshes, a run on some of the devices), the op never finished.
        with tf.device("/device:CPU:0"):
            if callable(init):
                init = init()
            init = tf.convert_to_tensor(init, dtype=kwargs.get("dtype"))
        return dtensor.DVariable(
            _to_mesh(init, layout_fn(init.shape)),
            trainable=kwargs.get("trainable", False),
            name=kwargs.get("name"),
        )

    with tf.variable_creator_scope(creator):
        yield


def create_state(
    optimizer,
    variables: Sequence[tf.Variable],
    mesh: dtensor.Mesh,
    slot_layout: Callable[[tf.Variable], dtensor.Layout] | None = None,
) -> None:
    """Creates the optimizer's step counter, hyperparameters and slots as DVariables.

    Args:
      optimizer: a legacy tf_keras optimizer (Model Garden's are).
      variables: the trainable DVariables.
      mesh: the mesh; scalars and hyperparameters are replicated on it.
      slot_layout: layout of a variable's slots (default: the variable's own layout).
    """
    slot_layout = slot_layout or (lambda v: dtensor.fetch_layout(v))
    with dvariable_scope(lambda shape: dtensor.Layout.replicated(mesh, shape.rank)):
        compat.create_optimizer_weights(optimizer)  # iterations and hyperparameters
    for v in variables:
        layout = slot_layout(v)
        with dvariable_scope(lambda shape, layout=layout: layout), tf.init_scope():
            compat.create_slots(optimizer, v)


def slot_variables(optimizer) -> list[tf.Variable]:
    """All slot variables of a legacy optimizer, in creation order."""
    return [s for slots in compat.slot_table(optimizer).values() for s in slots.values()]


class GradientHomes:
    """Where a step's gradients live and their weights' updates run, as `Update.step` asks:
    here every gradient on the step's one mesh (the one-mesh executor's); a pipeline's
    executor hands its own (tfpod.pipeline.StageHomes: each gradient on its stage, the norm
    summed on the first). How a gradient updates its weight is `Update`'s, whatever its home.
    """

    def global_norm(self, grads: Sequence[tf.Tensor]) -> tf.Tensor:
        """The gradients' global norm (tf.linalg.global_norm)."""
        return tf.linalg.global_norm(grads)

    def clip_scales(self, grads: Sequence[tf.Tensor], norm: tf.Tensor, clip_norm: float) -> list[tf.Tensor]:
        """Per gradient, the factor that clips the global norm to `clip_norm` (NaN when the norm
        is not finite), where that gradient lives: tf.clip_by_global_norm's, as it computes it."""
        scale = clip_norm * tf.minimum(1.0 / norm, tf.constant(1.0, dtype=norm.dtype) / clip_norm)
        return [scale + (norm - norm)] * len(grads)

    def all_finite(self, loss: tf.Tensor, norm: tf.Tensor) -> tf.Tensor:
        """Whether the step's loss and gradient norm are finite."""
        return tf.math.is_finite(loss) & tf.math.is_finite(norm)

    def apply(self, update: "Update", grads: Sequence[tf.Tensor], finite: tf.Tensor) -> None:
        """Every weight's update (`update.apply`) when `finite`, else only the step counter advances."""
        tf.cond(finite, lambda: update.apply(grads), update.skip)


class Update:
    """Applies gradients to the weights, optionally sharding the update over a mesh axis.

    Args:
      optimizer: a legacy tf_keras optimizer (Model Garden's are), no state yet.
      variables: the trainable DVariables (AutoCastVariables under mixed precision).
      mesh: the mesh.
      axis: mesh axis to shard the optimizer state and update over (None: each slot is
        laid out like its weight and the update runs where the weight lives).
    """

    def __init__(self, optimizer, variables, mesh: dtensor.Mesh, axis: str | None = None):
        self.optimizer, self.variables, self.mesh, self.axis = optimizer, list(variables), mesh, axis
        self.shadows = []  # per variable: its sharded working copy, or None
        self.shadow_layouts = []
        self.layouts = [dtensor.fetch_layout(v) for v in self.variables]  # fetch_layout is eager-only
        for v, layout in zip(self.variables, self.layouts):
            target = partitioning.update_layout(layout, v.shape, axis)
            if target == layout:
                self.shadows.append(None)
                self.shadow_layouts.append(None)
                continue
            name = v.name[:-2] if v.name.endswith(":0") else v.name  # weight-decay exclusions match names
            with tf.init_scope():
                shadow = dtensor.DVariable(dtensor.relayout(_value(v), target), trainable=False, name=name)
            self.shadows.append(shadow)
            self.shadow_layouts.append(target)
        targets = [s if s is not None else v for v, s in zip(self.variables, self.shadows)]
        create_state(optimizer, targets, mesh)
        slots = compat.slot_table(optimizer)
        for v, s in zip(self.variables, self.shadows):
            if s is not None:  # checkpoints (and get_slot) find the slots under the weight
                slots[compat.var_key(v)] = slots.setdefault(compat.var_key(s), {})

    def shadow_list(self) -> list:
        """The sharded working copies of weights (weight-update sharding)."""
        return [s for s in self.shadows if s is not None]

    @property
    def sharded(self) -> bool:
        """Whether any weight's update is sharded."""
        return any(s is not None for s in self.shadows)

    def step(self, loss: tf.Tensor, grads: Sequence[tf.Tensor], clip_norm: float | None,
             homes: GradientHomes | None = None) -> tuple[tf.Tensor, tf.Tensor]:
        """The one update every executor's step ends in (inside the compiled step): the
        gradients' global norm, global-norm clipping (`clip_norm`; None or 0: off), and the
        update, applied only when the loss and the norm are finite (else only the step
        counter advances, so weights and slots keep finite values).

        Args:
          loss: the step's loss.
          grads: per variable (in `variables`' order) its gradient.
          clip_norm: the global norm to clip to.
          homes: where each gradient lives and its update runs, from the step's executor
            (default: all on one mesh).

        Returns:
          (loss, gradient norm).
        """
        homes = homes or GradientHomes()
        norm = homes.global_norm(grads)
        if clip_norm:
            grads = self.scaled(grads, homes.clip_scales(grads, norm, clip_norm))
        homes.apply(self, grads, homes.all_finite(loss, norm))
        return loss, norm

    @staticmethod
    def scaled(grads: Sequence[tf.Tensor], scales: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Each gradient times its clipping scale (a scalar where the gradient lives).

        The product passes an Identity, as in tf.clip_by_global_norm: without it, DTensor's
        layout propagation carried the update's layouts back into the step and a context
        mesh's q/k/v transposes failed SPMD expansion ("TransposeOp SPMD needs communication",
        `context:2,model:2,data:2` under `2d`). A gradient that is a structure of tensors (an
        embedding table's rows, tfpod.embedding.sparse.Rows) scales and passes as one."""
        return [tf.nest.map_structure(tf.identity, g * tf.cast(scale, g.dtype)) for g, scale in zip(grads, scales)]

    def apply(self, grads: Sequence[tf.Tensor], indices: Sequence[int] | None = None, coefficients=None) -> None:
        """One optimizer update of the weights at `indices` (all by default) from their
        gradients (inside the compiled step): each gradient put in its weight's (or working
        copy's) layout, the optimizer's update, the updated shards gathered back.

        Args:
          grads: per variable, its gradient.
          indices: which variables to update.
          coefficients: the step's coefficients (`coefficients()`, copied where these weights
            live): the update uses them and leaves the step counter (the caller `advance`s it
            once); None: the optimizer's own `apply_gradients`, which computes them and
            advances the step counter.
        """
        indices = range(len(self.variables)) if indices is None else list(indices)
        pairs = self._pairs(grads, indices)
        if coefficients is None:
            applied = self.optimizer.apply_gradients(pairs)
        else:
            applied = compat.apply_updates(self.optimizer, pairs, coefficients)
        # (runtime.initialize turns off DTensor's all-reduce combining, which reordered this)
        with tf.control_dependencies([applied]):
            self._write_back(indices)

    def coefficients(self) -> dict:
        """The step's coefficients of every weight's update (learning rate, beta powers, ...)."""
        return compat.prepare_updates(self.optimizer, self.variables)

    def scalars(self) -> list[tf.Variable]:
        """The step counter and the hyperparameter variables (the state other than slots)."""
        return compat.optimizer_scalars(self.optimizer)

    def skip(self) -> None:
        """A step whose update is not applied: the batch is consumed, the step counter stays in step."""
        self.optimizer.iterations.assign_add(1)

    def advance(self) -> None:
        """Advances the step counter once (after `apply` with coefficients)."""
        self.optimizer.iterations.assign_add(1, read_value=False)

    def _pairs(self, grads: Sequence[tf.Tensor], indices) -> list:
        # Each gradient is put in its variable's (or working copy's) layout first: a
        # gradient left in the layout DTensor propagated (e.g. sequence-sharded
        # layer-norm gradients) crashed the optimizer's SPMD expansion.
        pairs = []
        for j in indices:
            g, v, s = grads[j], self.variables[j], self.shadows[j]
            pairs.append((dtensor.relayout(g, self.layouts[j]), v) if s is None
                         else (dtensor.relayout(g, self.shadow_layouts[j]), s))
        return pairs

    def _write_back(self, indices) -> None:
        for j in indices:
            if self.shadows[j] is not None:  # all-gather the updated shard back into the weight
                self.variables[j].assign(dtensor.relayout(self.shadows[j].read_value(), self.layouts[j]),
                                         read_value=False)

    def state_specs(self) -> tuple[list, dict]:
        """(VarSpecs, {name: Layout}) of the optimizer state, for the layout report.

        Slots are named `<weight>/<slot>`; sharded working copies `<weight>/update_shard`.
        """
        specs, layouts = [], {}
        for v, s in zip(self.variables, self.shadows):
            name = v.name[:-2] if v.name.endswith(":0") else v.name
            entries = list(compat.slot_table(self.optimizer).get(compat.var_key(v), {}).items())
            if s is not None:
                entries.append(("update_shard", s))
            for slot_name, slot in entries:
                full = f"{name}/{slot_name}"
                specs.append(partitioning.VarSpec(full, tuple(slot.shape.as_list()), slot.dtype))
                layouts[full] = dtensor.fetch_layout(slot)
        return specs, layouts


def _value(v) -> tf.Tensor:
    """The value of a (possibly AutoCast) DVariable as a tensor in its own dtype."""
    return compat.inner_variable(v).read_value()
