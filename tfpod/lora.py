"""LoRA: low-rank adapters trained on a frozen model (Hu et al. 2021, arXiv 2106.09685, as
Hugging Face PEFT defines them).

A target weight W (a kernel [*in_dims, *out_dims] of a linear layer: tfpod's Projection,
Keras's Dense or EinsumDense) gets two trainable weights beside it,

    lora_a [*in_dims, rank]    initialized uniform in +-1/sqrt(prod(in_dims)) (PEFT's
                               kaiming_uniform(a=sqrt(5)))
    lora_b [rank, *out_dims]   initialized to zero, so the adapted model starts as the base

and the layer computes  y = layer(x) + (alpha / rank) * ((dropout(x) @ lora_a) @ lora_b),
never W + A @ B: the base weight gets no gradient, and a step multiplies tokens by the
rank-r factors only. Every other weight is frozen (moved to its layer's non-trainable
weights: no gradient, no optimizer slot) unless `lora.trainable` names it.

The adapters take their layouts from their base weight's rule (AdapterRule): lora_a the
base's input axes and an unsplit rank, lora_b an unsplit rank and the base's output
axes, so every preset that splits the base (tensor, 2d, weight_update) splits the
adapters along the same dimensions. `adapt(task, config)` is the task with adapters:
every part of tfpod that builds the task's model (training, evaluation, the planner,
export) builds them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import string
import weakref

import tensorflow as tf
import tf_keras

from tfpod import UserError, compat
from tfpod.partitioning import AxisRule
from tfpod.projection import Projection

NAME = "lora"
PARTS = ("lora_a", "lora_b")

# Named groups of targets (lora.targets takes these names or regexes over kernel names).
TARGET_GROUPS = {
    "attention": r".*/self_attention/(query|key|value|attention_output)/kernel",
    "mlp": r".*/((block|layer)_\d+/(intermediate|output)|mlp/(gate|up|down))/kernel",
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters. Attributes map 1:1 to gin `lora.<name>`.

    Attributes:
      rank: the adapters' rank r (0: no adapters, the whole model trains).
      alpha: the adapters' output is scaled by alpha / rank (PEFT's lora_alpha).
      dropout: dropout on each adapter's input (PEFT's lora_dropout), in training.
      targets: the weights that get adapters: names of TARGET_GROUPS ("attention":
        query, key, value and attention output; "mlp": the MLP projections) or regexes
        matching whole kernel names (as sharding rules do, see layouts.txt).
      trainable: regexes of other variables that keep training (e.g. the norms, a new
        head); every variable neither an adapter nor matched here is frozen.
      shared_qkv: key and value use the query's lora_a (and its dropout mask), each its
        own lora_b: the adapter of one fused qkv projection (a qkv_proj target, as MLPerf's
        Llama 2 70B LoRA reference has), with rank r for the three.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple = ("attention",)
    trainable: tuple = ()
    shared_qkv: bool = False

    def __post_init__(self):
        if self.rank < 0:
            raise UserError(f"{NAME}.rank={self.rank} must be >= 0 (0: no adapters)")
        if not self.alpha > 0:
            raise UserError(f"{NAME}.alpha={self.alpha} must be positive (the adapters are scaled by alpha / rank)")
        if not 0 <= self.dropout < 1:
            raise UserError(f"{NAME}.dropout={self.dropout} must be in [0, 1)")
        if self.rank and not self.targets:
            raise UserError(f"{NAME}.targets is empty: name the weights that get adapters, e.g. ('attention',)")
        for field in ("targets", "trainable"):
            for pattern in getattr(self, field):
                try:
                    re.compile(TARGET_GROUPS.get(pattern, pattern))
                except re.error as e:
                    raise UserError(f"{NAME}.{field}: {pattern!r} is not a group name ({', '.join(TARGET_GROUPS)}) "
                                    f"nor a valid regex ({e})") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def target_patterns(self) -> list[str]:
        return [TARGET_GROUPS.get(t, t) for t in self.targets]


def var_name(v) -> str:
    return v.name[:-2] if v.name.endswith(":0") else v.name


def input_dims(layer) -> int | None:
    """How many leading kernel dimensions a linear layer contracts with its input's last ones
    (None: not a layer LoRA knows)."""
    if isinstance(layer, Projection):  # kernel [*in_dims, *out_dims]
        return len(layer.in_dims)
    if isinstance(layer, tf_keras.layers.EinsumDense):
        inputs, kernel = layer.equation.split("->")[0].split(",")
        k = len([c for c in kernel if c in inputs])
        if kernel[:k] == inputs[len(inputs) - k:] and not set(kernel[k:]) & set(inputs):
            return k
        return None
    if isinstance(layer, tf_keras.layers.Dense):
        return 1
    return None


class AdapterRule(AxisRule):
    """The layout rule of one adapter part ("lora_a" or "lora_b") of the weights `base` lays out:
    lora_a [*in, rank] takes the base's input axes, lora_b [rank, *out] its output axes, the
    rank unsplit. Optional: a base rule need not have adapters."""

    def __init__(self, base: AxisRule, part: str):
        super().__init__(f"{base.pattern} ({part})", base.axes, optional=True)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "part", part)

    def matches(self, name: str) -> bool:
        suffix = "/" + self.part
        return name.endswith(suffix) and self.base.matches(name[: -len(suffix)] + "/kernel")

    def axes_for(self, shape) -> tuple:
        n = len(shape) - 1  # the base's dimensions this part keeps
        if self.part == "lora_a":
            return tuple(self.base.axes[:n]) + (None,)
        return (None,) + tuple(self.base.axes[len(self.base.axes) - n:])


def adapter_rules(axis_rules) -> tuple:
    """The adapters' rules, derived from the task's (one pair per rule)."""
    return tuple(AdapterRule(r, part) for r in axis_rules for part in PARTS)


def _einsum(x_rank: int, k: int, out_rank: int) -> tuple[str, str]:
    """The two einsums of an adapter: x [..., *in] @ lora_a -> [..., r]; that @ lora_b -> [..., *out]."""
    letters = iter(string.ascii_lowercase.replace("r", ""))
    lead = "".join(next(letters) for _ in range(x_rank - k))
    contracted = "".join(next(letters) for _ in range(k))
    out = "".join(next(letters) for _ in range(out_rank))
    return f"{lead}{contracted},{contracted}r->{lead}r", f"{lead}r,r{out}->{lead}{out}"


# The layers `install` gave adapters (held weakly: a model's layers go with it).
_ADAPTED: weakref.WeakSet = weakref.WeakSet()


def install(layer, config: LoraConfig, shared=None) -> None:
    """Gives a built linear layer its adapter weights and makes its call add their output;
    with `shared` (a layer that has them), that layer's lora_a and dropout."""
    kernel = layer.kernel
    k = input_dims(layer)
    name = var_name(kernel)
    if k is None:
        raise UserError(f"{NAME}.targets matches {name}, a weight of a {type(layer).__name__} layer: adapters go on "
                        "linear layers (tfpod's Projection, Keras Dense or EinsumDense); narrow lora.targets")
    activation = getattr(layer, "activation", None)
    if activation is not None and getattr(activation, "__name__", None) != "linear":
        raise UserError(f"{NAME}.targets matches {name}, whose layer applies an activation: an adapter adds to a "
                        "linear output; narrow lora.targets")
    shape = kernel.shape.as_list()
    fan_in = math.prod(shape[:k])
    bound = 1.0 / math.sqrt(fan_in)
    if shared is not None:
        layer.lora_a, layer.lora_dropout = shared.lora_a, shared.lora_dropout
    else:
        layer.lora_a = layer.add_weight(
            "lora_a", shape[:k] + [config.rank], initializer=tf_keras.initializers.RandomUniform(-bound, bound))
        layer.lora_dropout = tf_keras.layers.Dropout(config.dropout, name="lora_dropout") if config.dropout else None
    layer.lora_b = layer.add_weight("lora_b", [config.rank] + shape[k:], initializer="zeros")
    _ADAPTED.add(layer)
    call = layer.call
    scale = config.scale

    def adapted_call(inputs, *args, **kwargs):
        y = call(inputs, *args, **kwargs)
        x = layer.lora_dropout(inputs) if layer.lora_dropout is not None else inputs
        first, second = _einsum(x.shape.rank, k, len(shape) - k)
        delta = tf.einsum(second, tf.einsum(first, x, layer.lora_a), layer.lora_b)
        return y + tf.cast(scale, y.dtype) * tf.cast(delta, y.dtype)

    layer.call = adapted_call


def freeze(model, config: LoraConfig) -> None:
    """Moves every weight but the adapters and those `config.trainable` names to its layer's
    non-trainable weights (no gradient, no optimizer state; still checkpointed).

    Raises:
      UserError: a lora.trainable regex that matches no variable.
    """
    keep = [re.compile(p) for p in config.trainable]
    used = set()
    for layer in compat.flatten_layers(model):
        trainable, frozen = compat.weight_lists(layer)
        for v in list(trainable):
            name = var_name(v)
            if name.endswith(tuple("/" + p for p in PARTS)):
                continue
            hits = [p.pattern for p in keep if p.fullmatch(name)]
            used.update(hits)
            if not hits:
                trainable.remove(v)
                frozen.append(v)
                # and the variable itself: the DVariable that replaces it when the model is placed
                # (and Keras, which files a variable set on a layer by this flag) keep it frozen
                compat.set_trainable(v, False)
    unused = [p for p in config.trainable if p not in used]
    if unused:
        raise UserError(f"{NAME}.trainable: {unused[0]!r} matches no trainable variable: fix the regex (it must "
                        "match a whole variable name, see layouts.txt) or remove it")


def adapting_build(build, config: LoraConfig):
    """`build` (config -> unbuilt model) whose model, when its first call builds it, installs
    adapters on the layers whose kernels `config` targets and freezes the rest."""
    patterns = [re.compile(p) for p in config.target_patterns()]

    def adapted(model_config):
        model = build(model_config)
        call = model.call
        found = []

        installed = {}  # kernel name -> its layer

        def on_build(layer, inputs, build_layer):
            result = build_layer(inputs)
            kernel = getattr(layer, "kernel", None)
            if isinstance(kernel, tf.Variable) and any(p.fullmatch(var_name(kernel)) for p in patterns):
                name = var_name(kernel)
                shared = None
                if config.shared_qkv and re.search(r"/(key|value)/kernel$", name):
                    query = re.sub(r"/(key|value)/kernel$", "/query/kernel", name)
                    if query not in installed:
                        raise UserError(f"{NAME}.shared_qkv: {name} has an adapter but {query} has none to share: "
                                        "target query, key and value together (lora.targets includes 'attention')")
                    shared = installed[query]
                with tf.init_scope():  # as Keras builds a layer: variables made eagerly
                    install(layer, config, shared)
                installed[name] = layer
                found.append(name)
            return result

        def first_call(*args, **kwargs):
            with compat.intercepting_layer_builds(on_build):
                outputs = call(*args, **kwargs)
            model.call = call
            if not found:
                raise UserError(f"{NAME}.targets={config.targets!r} matches no kernel of this model: use a group "
                                f"name ({', '.join(TARGET_GROUPS)}) or a regex over the kernel names in layouts.txt")
            freeze(model, config)
            return outputs

        model.call = first_call
        return model

    return adapted


def step_flops_per_token(task, config, variables) -> float:
    """Task.step_flops_per_token of an adapted task: the base's model FLOPs less the frozen
    weights' own gradients (2 of a weight's 6 FLOPs a token), plus 6 per adapter weight.
    lora.trainable weights are counted as frozen (norms and biases do no matmul; a trainable
    head's gradient is not counted); a base task that does not split its weights' FLOPs
    (weight_flops_per_token None) keeps its full count."""
    base = task.base_task
    full, weights = base.flops_per_token(config), base.weight_flops_per_token(config)
    if weights is None:
        return full
    adapters = sum(math.prod(tuple(v.shape)) for v in variables
                   if re.search(r"/lora_[ab](:\d+)?$", v.name))
    return full - weights / 3.0 + 6.0 * adapters


def adapt(task, config: LoraConfig):
    """The task whose model has adapters (config.enabled), else the task itself."""
    if not config.enabled:
        return task
    cls = type(task)
    adapted = type(f"LoRA{cls.__name__}", (cls,), {
        "build": staticmethod(adapting_build(task.build, config)),
        "axis_rules": tuple(task.axis_rules) + adapter_rules(task.axis_rules),
        "lora": config,
        "base_task": task,
        "step_flops_per_token": step_flops_per_token,
    })
    return adapted()


def merged(model, plain, config: LoraConfig):
    """`plain` (the base task's built model) holding `model`'s weights with its adapters merged
    in: each target kernel W + (alpha / rank) * lora_a @ lora_b (PEFT's merge).

    Returns:
      plain.
    """
    values = {var_name(v): v for v in model.variables}
    adapters = adapters_of(model)
    for v in plain.variables:
        name = var_name(v)
        value = values[name].read_value()
        if name in adapters:
            a, b = adapters[name]
            delta = tf.tensordot(a.read_value(), b.read_value(), axes=1)
            value = value + tf.cast(config.scale, value.dtype) * tf.cast(delta, value.dtype)
        v.assign(value)
    return plain


def adapters_of(model) -> dict:
    """{kernel name: (its lora_a, its lora_b)} of an adapted model (a shared lora_a appears
    under each kernel that uses it)."""
    return {var_name(layer.kernel): (layer.lora_a, layer.lora_b) for layer in compat.flatten_layers(model)
            if layer in _ADAPTED}


def is_adapter_key(key: str) -> bool:
    """Whether a checkpoint key is an adapter's (a base model's checkpoint lacks them)."""
    return any(f"/{part}/" in key for part in PARTS)


BASE_FILE = "lora_base.json"  # in model_dir: the base a run's adapters were trained on


def saved_weights(model) -> tf.Module:
    """What the checkpoints of a LoRA run on a base checkpoint hold of its model (TrainState.saved):
    its trained weights (the adapters and lora.trainable's) by name; the frozen rest is the base's."""
    holder = tf.Module(name="lora")
    holder.trained = {var_name(v): v for v in model.trainable_variables}
    return holder


def base_record(path: str | None) -> dict:
    """What identifies a base: the checkpoint `train.init_from` named (None: the model's own
    fresh initialization) and a digest of its index (which holds every tensor's checksum)."""
    if path is None:
        return {"init_from": None, "index_sha256": None}
    with tf.io.gfile.GFile(path + ".index", "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"init_from": path if "://" in path else os.path.abspath(path), "index_sha256": digest}


def check_base(model_dir: str, path: str | None, resuming: bool, is_chief: bool) -> str | None:
    """Records the base of a run's adapters (a new run), or refuses to resume them on another;
    returns the base checkpoint the run's checkpoints leave the frozen weights to (None: the
    base is the model's fresh initialization, and the checkpoints hold all of it).

    Args:
      model_dir: the run's folder (holds BASE_FILE).
      path: the checkpoint train.init_from resolves to (None: unset).
      resuming: the run has a checkpoint of its own (its adapters were trained on the
        recorded base).
      is_chief: this host writes the record.

    Raises:
      UserError: resuming with a train.init_from other than the base the record names, or
        the recorded base is gone or was written over.
    """
    if resuming:
        return recorded_base(model_dir, path)
    if is_chief:
        tf.io.gfile.makedirs(model_dir)
        record_path = os.path.join(model_dir, BASE_FILE)
        tmp = record_path + ".tmp"
        with tf.io.gfile.GFile(tmp, "w") as f:
            json.dump(base_record(path), f, indent=1)
        tf.io.gfile.rename(tmp, record_path, overwrite=True)
    return path


def recorded_base(model_dir: str, path: str | None = None) -> str | None:
    """The base checkpoint run `model_dir`'s adapters were trained on (None: no record, or the
    model's fresh initialization: its checkpoints hold the whole model).

    Raises:
      UserError: `path` (train.init_from) is not that base, or the base is gone or was written over.
    """
    record_path = os.path.join(model_dir, BASE_FILE)
    if not tf.io.gfile.exists(record_path):
        return None  # the base is in the run's own checkpoints; nothing to compare
    with tf.io.gfile.GFile(record_path) as f:
        recorded = json.load(f)
    base = recorded["init_from"]
    if path is not None and base_record(path)["index_sha256"] != recorded["index_sha256"]:
        raise UserError(f"train.init_from={path} is not the base this run's adapters were trained on "
                        f"({base or 'a freshly initialized base (no train.init_from)'}, {record_path}): resume "
                        "with that base, or start a new --model_dir")
    if base is not None and not tf.io.gfile.exists(base + ".index"):
        raise UserError(f"this run's checkpoints hold its adapters, and their base {base} ({record_path}) is "
                        "gone: put it back where it was, or start a new --model_dir")
    if base is not None and base_record(base)["index_sha256"] != recorded["index_sha256"]:
        raise UserError(f"this run's adapters were trained on {base} ({record_path}), and it has been written "
                        "over since: put the original back, or start a new --model_dir")
    return base
