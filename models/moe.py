"""GShard mixture-of-experts causal LM: every `moe_every`-th block's MLP is a top-2 MoE layer.

The model is the GPT LM of `gpt.py` (same embedding, attention, tied output layer, batch
contract and data) whose blocks `moe_every - 1, 2 * moe_every - 1, ...` replace the dense
MLP with GShard's mixture of experts (arXiv 2006.16668, Algorithm 1; lingvo
`gshard_layers.Top2Gating`):

  * Tokens are routed in groups of `group_size` consecutive tokens of one sequence.
    Each token goes to its two best experts (softmax gates; the second is the best of
    the rest, always dispatched), each expert takes at most `capacity` tokens per group,
    first choices before second ones; a token over capacity is dropped from that expert
    (its MoE output is 0 there and the residual carries it).
  * The two gate values are normalized to sum to 1 and weight the experts' outputs.
  * A load-balancing loss, mean over experts of (fraction of the group's tokens whose
    first choice is e) * (mean gate of e) * experts^2, is 1 for uniform routing; the
    training loss adds `aux_loss_coef` times its mean over MoE blocks.

Partitioning (the `tensor` preset maps the logical axis `expert` to the mesh axis
`expert`): expert weights are split over `expert`. Inside the layer the tokens
[batch, length, embed] are viewed as [batch, groups, group_size, embed] with the groups
split over `expert` too (so every device routes distinct tokens), dispatched with an
einsum to [experts, batch, groups, capacity, embed] split over `expert` on the experts
dimension instead: moving the split from groups to experts is the all-to-all. The
experts run on their own devices, and the reverse relayout and the combine einsum bring
the outputs back. Routing is within one sequence, so it is the same on every mesh.

DTensor notes: Model Garden's `MoeLayer` failed SPMD expansion with experts on a mesh
axis; this layer uses only softmax, argmax, one_hot, cumsum, reductions, einsums and
explicit relayouts, and all of them expand under the layouts above (no op needed
replacing; tests/test_moe.py runs them on 8 devices against one device). DTensor lowers
the groups <-> experts relayout to its all-to-all (`DTENSOR_USE_ALL_TO_ALL_RELAYOUT`, on
by default; much faster than the gather-and-split it does with it off).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import tensorflow as tf
import tf_keras

from tfpod import UserError, fused, partitioning
from tfpod.input import lm_data
from tfpod.models import decoding, gpt, lm_serving, plan_profiles
from tfpod.partitioning import AxisRule, shard
from tfpod.task import LossTerms

NAME = "moe"

# Logical axes of the MoE layer's activations. The token groups and the experts are both
# split over the mesh axis of `expert` (one tensor never has both dimensions), so the
# relayout between the two layouts is GShard's all-to-all.
GROUPED_AXES = ("batch", "expert", None, "embed")  # [batch, groups, group_size, embed]
ROUTING_AXES = ("batch", "expert", None, None, None)  # [batch, groups, group_size, experts, capacity]
EXPERT_AXES = ("expert", "batch", None, None, "embed")  # [experts, batch, groups, capacity, embed]
EXPERT_HIDDEN_AXES = ("expert", "batch", None, None, "mlp")  # [experts, batch, groups, capacity, mlp]
RETURN_AXES = (None, "batch", "expert", None, "embed")  # [experts, batch, groups, capacity, embed]


@dataclasses.dataclass(frozen=True)
class MoEConfig(gpt.GPTConfig):
    """Shape of the MoE LM. Attributes map 1:1 to gin `moe.<name>`.

    Attributes (besides GPTConfig's; `mlp_dim` is the dense blocks' MLP width):
      num_experts: experts per MoE block (at least 2: top-2 gating).
      expert_mlp_dim: hidden width of each expert's MLP.
      moe_every: every moe_every-th block is a MoE block (GShard: 2), the others dense;
        at least 2 and at most num_layers, so the model has both kinds.
      group_size: tokens per routing group (consecutive tokens of one sequence); must
        divide seq_len. Capacity is per group and expert.
      capacity_factor: expert capacity relative to an even split of the 2 choices.
      min_capacity: the capacity is at least this.
      aux_loss_coef: weight of the load-balancing loss in the training loss.
    """

    num_experts: int = 8
    expert_mlp_dim: int = 512
    moe_every: int = 2
    group_size: int = 32
    capacity_factor: float = 2.0
    min_capacity: int = 4
    aux_loss_coef: float = 1e-2

    def __post_init__(self):
        try:
            super().__post_init__()
        except UserError as e:  # GPTConfig names its fields gpt.*; here they are moe.*
            raise UserError(str(e).replace("gpt.", f"{NAME}.")) from None
        for field in ("expert_mlp_dim", "group_size", "min_capacity"):
            if getattr(self, field) < 1:
                raise UserError(f"{NAME}.{field}={getattr(self, field)} must be at least 1")
        if self.num_experts < 2:
            raise UserError(f"{NAME}.num_experts={self.num_experts} must be at least 2: top-2 gating picks two experts")
        if not 2 <= self.moe_every <= self.num_layers:
            raise UserError(
                f"{NAME}.moe_every={self.moe_every} must be in [2, num_layers={self.num_layers}]: every "
                "moe_every-th block is MoE and the others dense, and the model needs one of each"
            )
        if self.seq_len % self.group_size:
            raise UserError(
                f"{NAME}.group_size={self.group_size} does not divide {NAME}.seq_len={self.seq_len}: "
                "routing groups are equal slices of a sequence; pick a divisor of seq_len"
            )
        if not self.capacity_factor > 0:
            raise UserError(f"{NAME}.capacity_factor={self.capacity_factor} must be positive (GShard uses 2.0)")
        if self.aux_loss_coef < 0:
            raise UserError(f"{NAME}.aux_loss_coef={self.aux_loss_coef} must be >= 0 (GShard uses 1e-2)")

    @property
    def capacity(self) -> int:
        """Tokens each expert takes per group: max(min_capacity, ceil(2 * group_size * factor / experts))."""
        return expert_capacity(self.group_size, self.num_experts, self.capacity_factor, self.min_capacity)

    def is_moe_block(self, i: int) -> bool:
        """Whether block i (from 0) is a MoE block: blocks moe_every-1, 2*moe_every-1, ..."""
        return (i + 1) % self.moe_every == 0

    @property
    def num_moe_blocks(self) -> int:
        return self.num_layers // self.moe_every


# gpt's rules cover embeddings, attention, layer norms and the dense blocks' MLPs.
AXIS_RULES = gpt.AXIS_RULES + (
    AxisRule(r".*/moe_mlp/gate_kernel", ("embed", None)),  # the router: every device routes its tokens
    AxisRule(r".*/moe_mlp/wi", ("expert", "embed", "mlp")),
    AxisRule(r".*/moe_mlp/wo", ("expert", "mlp", "embed")),
)


def expert_capacity(group_size: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """GShard's expert capacity per group: max(min_capacity, ceil(2 * group_size * factor / experts))."""
    return max(min_capacity, math.ceil(2 * group_size * capacity_factor / num_experts))


def top2_gating(logits: tf.Tensor, capacity: int):
    """GShard top-2 gating of groups of tokens (lingvo `Top2GatingOnLogits`, policy 'all').

    Args:
      logits: float32 [batch, groups, group_size, experts] router logits.
      capacity: slots per expert and group.

    Returns:
      (combine, dispatch, aux_loss): combine float32 [batch, groups, group_size, experts,
      capacity], the normalized gate of each kept (token, expert, slot) assignment, 0
      elsewhere; dispatch, the same shape, 1.0 where combine's assignment exists; aux_loss
      a float32 scalar, the load-balancing loss averaged over the groups.
    """
    num_experts = logits.shape[-1]
    gates = tf.nn.softmax(logits, axis=-1)  # [b, g, s, x]
    mask_1 = tf.one_hot(tf.argmax(gates, axis=-1), num_experts, dtype=gates.dtype)  # [b, g, s, x]: first choice
    gate_1 = tf.reduce_sum(gates * mask_1, axis=-1)  # [b, g, s]
    mask_2 = tf.one_hot(tf.argmax(gates * (1.0 - mask_1), axis=-1), num_experts, dtype=gates.dtype)  # second choice
    gate_2 = tf.reduce_sum(gates * mask_2, axis=-1)  # [b, g, s]
    denom = gate_1 + gate_2 + 1e-9
    gate_1, gate_2 = gate_1 / denom, gate_2 / denom

    # Load balance, from the choices before any are dropped: per group, the fraction of
    # tokens whose first choice is e times the mean gate of e, summed over e * experts.
    density = tf.reduce_mean(mask_1, axis=2)  # [b, g, x]
    density_proxy = tf.reduce_mean(gates, axis=2)  # [b, g, x]
    aux_loss = tf.reduce_mean(density * density_proxy) * float(num_experts**2)

    # Slots: first choices fill each expert in token order, then the second choices.
    position_1 = tf.math.cumsum(mask_1, axis=2, exclusive=True)  # [b, g, s, x]: earlier first choices of x
    mask_1 *= tf.cast(position_1 < capacity, mask_1.dtype)  # over capacity: dropped
    kept_1 = tf.reduce_sum(mask_1, axis=2, keepdims=True)  # [b, g, 1, x]
    position_2 = tf.math.cumsum(mask_2, axis=2, exclusive=True) + kept_1  # [b, g, s, x]
    mask_2 *= tf.cast(position_2 < capacity, mask_2.dtype)

    def assignment(mask, position, gate):
        slot = tf.cast(tf.reduce_sum(position * mask, axis=-1), tf.int32)  # [b, g, s]: 0 where dropped
        slot = tf.one_hot(slot, capacity, dtype=mask.dtype)  # [b, g, s, c]
        dispatch = tf.einsum("bgsx,bgsc->bgsxc", mask, slot)  # [b, g, s, x, c]
        return dispatch, dispatch * gate[:, :, :, None, None]

    dispatch_1, combine_1 = assignment(mask_1, position_1, gate_1)
    dispatch_2, combine_2 = assignment(mask_2, position_2, gate_2)
    return combine_1 + combine_2, dispatch_1 + dispatch_2, aux_loss


class MoEMLP(tf_keras.layers.Layer):
    """GShard top-2 mixture-of-experts MLP: [batch, length, embed] -> ([batch, length, embed], aux_loss).

    Args:
      num_experts: experts (weights wi [experts, embed, mlp_dim], wo [experts, mlp_dim, embed]).
      mlp_dim: each expert's hidden width.
      group_size: tokens per routing group; must divide the input length.
      capacity: slots per expert and group.
      activation: the experts' hidden activation.
      kernel_initializer: () -> initializer, called once per weight.
    """

    def __init__(self, num_experts: int, mlp_dim: int, group_size: int, capacity: int, activation: str = "gelu",
                 kernel_initializer=None, **kwargs):
        super().__init__(**kwargs)
        if num_experts < 2 or mlp_dim < 1 or group_size < 1 or capacity < 1:
            raise ValueError(f"MoEMLP got num_experts={num_experts}, mlp_dim={mlp_dim}, group_size={group_size}, "
                             f"capacity={capacity}: expected at least 2 experts and positive sizes")
        self.num_experts, self.mlp_dim, self.group_size, self.capacity = num_experts, mlp_dim, group_size, capacity
        self.activation = fused.activation(activation)
        self._activation_name = activation
        self._initializer = kernel_initializer or (lambda: tf_keras.initializers.TruncatedNormal(stddev=0.02))

    def build(self, input_shape):
        length, embed = input_shape[-2], input_shape[-1]
        if length is not None and length % self.group_size:
            raise ValueError(f"MoEMLP got length {length}, not divisible by group_size {self.group_size}")
        # The router stays float32 under mixed precision (GShard computes gating in float32).
        self.gate_kernel = self.add_weight("gate_kernel", [embed, self.num_experts], initializer=self._initializer(),
                                           dtype=tf.float32, experimental_autocast=False)
        self.wi = self.add_weight("wi", [self.num_experts, embed, self.mlp_dim], initializer=self._initializer())
        self.wo = self.add_weight("wo", [self.num_experts, self.mlp_dim, embed], initializer=self._initializer())
        super().build(input_shape)

    def route(self, grouped: tf.Tensor, capacity: int | None = None):
        """Gating of grouped tokens [batch, groups, group_size, embed] (capacity: the layer's
        by default); see top2_gating."""
        logits = tf.einsum("bgsm,mx->bgsx", tf.cast(grouped, tf.float32), self.gate_kernel)
        combine, dispatch, aux_loss = top2_gating(shard(logits, ROUTING_AXES[:4]), capacity or self.capacity)
        return shard(combine, ROUTING_AXES), shard(dispatch, ROUTING_AXES), aux_loss

    def dispatch(self, grouped: tf.Tensor, dispatch: tf.Tensor) -> tf.Tensor:
        """Tokens to expert slots: [experts, batch, groups, capacity, embed], split over experts (all-to-all)."""
        expert_in = tf.einsum("bgsxc,bgsm->xbgcm", tf.cast(dispatch, grouped.dtype), grouped)
        return shard(expert_in, EXPERT_AXES)

    def experts(self, expert_in: tf.Tensor) -> tf.Tensor:
        """Each expert's MLP on its slots: [experts, batch, groups, capacity, embed] -> the same shape."""
        hidden = tf.einsum("xbgcm,xmh->xbgch", expert_in, self.wi)  # [experts, batch, groups, capacity, mlp]
        hidden = shard(self.activation(hidden), EXPERT_HIDDEN_AXES)
        return shard(tf.einsum("xbgch,xhm->xbgcm", hidden, self.wo), EXPERT_AXES)

    def combine(self, expert_out: tf.Tensor, combine: tf.Tensor) -> tf.Tensor:
        """Expert outputs back to the tokens (reverse all-to-all), weighted by their gates: [b, g, s, embed]."""
        expert_out = shard(expert_out, RETURN_AXES)  # the split moves from experts back to groups
        grouped = tf.einsum("bgsxc,xbgcm->bgsm", tf.cast(combine, expert_out.dtype), expert_out)
        return shard(grouped, GROUPED_AXES)

    def _check_groups_divide(self, groups: int) -> None:
        """Raises UserError when the groups of a sequence do not split over the experts' mesh axis.

        DTensor would fail later with an unreadable MLIR message.
        """
        active = partitioning.active_context()
        if active is None:
            return
        mesh, table = active.mesh, active.table
        axis = table.get("expert")
        if axis in mesh.dim_names and groups % mesh.dim_size(axis):
            n = mesh.dim_size(axis)
            raise UserError(
                f"{self.name}: {groups} routing groups per sequence (length {groups * self.group_size} / group_size "
                f"{self.group_size}) do not divide over mesh axis {axis!r} of size {n}: pick a group_size that makes "
                f"length / group_size a multiple of {n}, or map 'expert' to no mesh axis in sharding.rules"
            )

    def call(self, x: tf.Tensor, each_token: bool = False):
        """x [batch, length, embed] -> (y [batch, length, embed], aux_loss float32 scalar).

        With `each_token` (generation: models/decoding.py) every token is a group of its own
        with one slot per expert: the same gates and top-2 choices, and no token is dropped.
        """
        length, embed = x.shape[-2], x.shape[-1]
        if each_token:
            length = tf.shape(x)[1]
            group_size, capacity, groups = 1, 1, length
        else:
            group_size, capacity, groups = self.group_size, self.capacity, length // self.group_size
            self._check_groups_divide(groups)
        grouped = tf.reshape(x, [-1, groups, group_size, embed])  # [b, g, s, embed]
        grouped = shard(grouped, GROUPED_AXES)
        combine, dispatch, aux_loss = self.route(grouped, capacity)
        y = self.combine(self.experts(self.dispatch(grouped, dispatch)), combine)
        return tf.reshape(y, [-1, length, embed]), aux_loss  # [batch, length, embed]

    def get_config(self):
        return {**super().get_config(), "num_experts": self.num_experts, "mlp_dim": self.mlp_dim,
                "group_size": self.group_size, "capacity": self.capacity, "activation": self._activation_name}


class MoEBlock(tf_keras.layers.Layer):
    """Pre-norm Transformer block whose MLP is a MoEMLP.

    Called as block([x [batch, length, embed], mask [batch, length, length]]) ->
    (x [batch, length, embed], aux_loss). Laid out like gpt's `Block` (Model Garden's
    `TransformerEncoderBlock` with norm_first: same sublayer names and attention layer, so
    gpt's attention and layer-norm rules apply): layer norm -> causal self-attention -> dropout -> residual
    -> layer norm -> MoE MLP -> dropout -> residual.

    Args:
      config: the model's MoEConfig.
      kernel_initializer: () -> initializer, called once per weight.
    """

    def __init__(self, config: MoEConfig, kernel_initializer, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        c = config
        self.attention_layer_norm = tf_keras.layers.LayerNormalization(
            epsilon=c.norm_epsilon, dtype=tf.float32, name="self_attention_layer_norm")  # float32, as Model Garden
        self.attention = gpt.CausalSelfAttention(c.num_heads, c.embed_dim, c.attention_dropout, kernel_initializer,
                                                 causal=True, name="self_attention")
        # Model Garden's block drops the attention output at the attention dropout rate.
        self.attention_dropout = tf_keras.layers.Dropout(c.attention_dropout)
        self.output_layer_norm = tf_keras.layers.LayerNormalization(
            epsilon=c.norm_epsilon, dtype=tf.float32, name="output_layer_norm")
        self.moe_mlp = MoEMLP(c.num_experts, c.expert_mlp_dim, c.group_size, c.capacity, c.activation,
                              kernel_initializer, name="moe_mlp")
        self.output_dropout = tf_keras.layers.Dropout(c.dropout)

    def call(self, inputs, training=None):
        x, mask = inputs
        h = self.attention_layer_norm(x)
        h = self.attention(tf.cast(h, self.compute_dtype), mask, training=training)
        x = x + self.attention_dropout(h, training=training)
        # Handed a decoding.LayerCache for the mask (generation), each token routes on its own.
        y, aux_loss = self.moe_mlp(self.output_layer_norm(x), each_token=isinstance(mask, decoding.LayerCache))
        return x + self.output_dropout(y, training=training), aux_loss

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}


class MoELM(gpt.GPT):
    """Causal LM with MoE blocks: token ids [batch, length] -> logits [batch, length, vocab].

    After each call, `aux_loss()` is the mean load-balancing loss of its MoE blocks.
    """

    def __init__(self, config: MoEConfig, name: str = NAME):
        super().__init__(config, name=name)

    def make_block(self, i: int, init) -> tf_keras.layers.Layer:
        """Block i: a MoEBlock every moe_every-th block, else gpt's dense block."""
        if self.config.is_moe_block(i):
            return MoEBlock(self.config, init, name=f"block_{i}")
        return super().make_block(i, init)

    def run_block(self, block, x, mask, training):
        """One block; a MoE block's aux loss is recorded with add_loss (outside any recomputation).

        With `remat` the aux loss is an output of the recomputed function, so its gradient
        reaches the router.
        """
        if not isinstance(block, MoEBlock):
            return super().run_block(block, x, mask, training)
        x, aux_loss = self._moe_block(block, x, mask, training)
        self.add_loss(aux_loss)
        return x

    def decode_block(self, block, x, cache):
        """One block of `decode`: a MoE block routes each token as a group of its own."""
        if not isinstance(block, MoEBlock):
            return super().decode_block(block, x, cache)
        return block([x, cache], training=False)[0]

    def block_and_aux(self, block, x, mask, training):
        """One block as a pipeline stage runs it: (x, aux_loss_coef x its aux loss / MoE blocks),
        its share of the loss's `aux_loss_coef * aux_loss` term."""
        if not isinstance(block, MoEBlock):
            return super().block_and_aux(block, x, mask, training)
        x, aux_loss = self._moe_block(block, x, mask, training)
        c = self.config
        return x, tf.cast(aux_loss, tf.float32) * (c.aux_loss_coef / c.num_moe_blocks)

    def _moe_block(self, block, x, mask, training):
        fn = lambda x, mask: block([x, mask], training=training)
        if self.config.remat:
            fn = tf.recompute_grad(fn)
        return fn(x, mask)

    def aux_loss(self) -> tf.Tensor:
        """Mean load-balancing loss over the MoE blocks of the latest call (float32 scalar).

        The MoE blocks' aux losses are the model's only Keras losses (it has no regularizers).
        """
        losses = self.losses
        if len(losses) != self.config.num_moe_blocks:
            raise ValueError(
                f"expected {self.config.num_moe_blocks} MoE aux losses from the latest call, got {len(losses)}"
            )
        return tf.add_n([tf.cast(l, tf.float32) for l in losses]) / float(len(losses))


def loss_terms(model: MoELM, batch: dict, training: bool) -> LossTerms:
    """Next-token cross entropy (gpt's terms) plus, as the aux term, aux_loss_coef times the
    mean MoE load-balancing loss.

    Returns:
      LossTerms with metrics {"loss_sum", "weight_sum"} (the LM loss alone, as evaluation
      reads it), "lm_loss" (this batch's) and "aux_loss", float32 scalars.
    """
    terms = gpt.loss_terms(model, batch, training)
    aux_loss = model.aux_loss()
    metrics = dict(terms.metrics)
    metrics.update(lm_loss=metrics["loss_sum"] / tf.maximum(metrics["weight_sum"], 1.0), aux_loss=aux_loss)
    return LossTerms(terms.sums, aux=model.config.aux_loss_coef * aux_loss, metrics=metrics)


def weight_flops_per_token(config: MoEConfig) -> float:
    """6 x the weights a token multiplies (flops_per_token's first term)."""
    return flops_per_token(config) - 12.0 * config.num_layers * config.seq_len * config.embed_dim


def flops_per_token(config: MoEConfig) -> float:
    """Model FLOPs per trained token (forward + backward) of what a token computes.

    6 * (the weights a token multiplies) + 12 * layers * length * embed (attention scores
    and values), as gpt's count, where a MoE block's token multiplies the router
    (embed x experts) and its top-2 experts' MLPs (2 x 2 x embed x expert_mlp_dim)
    instead of the dense MLP. The one-hot dispatch and combine einsums (2 x experts x
    capacity x embed each per token) are routing overhead, not counted, like softmax.
    """
    e, l = config.embed_dim, config.num_layers
    moe = config.num_moe_blocks
    attention = 4 * e * e  # q, k, v, out
    dense_mlp = 2 * e * config.mlp_dim
    moe_mlp = e * config.num_experts + 2 * (2 * e * config.expert_mlp_dim)
    weights = l * attention + (l - moe) * dense_mlp + moe * moe_mlp + config.vocab_size * e
    return 6.0 * weights + 12.0 * l * config.seq_len * e


class MoETask(gpt.GPTTask):
    """The GShard MoE LM: gin `moe.*`; the GPT task's batches, data (`lm_data.*`), eval and serving."""

    name = NAME
    config_class = MoEConfig
    axis_rules = AXIS_RULES

    build = staticmethod(MoELM)
    make_input = staticmethod(functools.partial(lm_data.lm_input, model=NAME))  # its messages say moe.*
    loss_terms = staticmethod(loss_terms)
    # Its routing groups are slices of seq_len tokens: served on ids padded to seq_len.
    serving = staticmethod(functools.partial(lm_serving.serving, whole_sequences=True))
    flops_per_token = staticmethod(flops_per_token)
    weight_flops_per_token = staticmethod(weight_flops_per_token)
    plan_profile = staticmethod(functools.partial(plan_profiles.moe, flops=flops_per_token))


TASK = MoETask()
