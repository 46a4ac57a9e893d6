"""What a task's training step keeps and moves, in logical axes: the planner's input from a task.

A task describes its step per example (`Task.plan_profile`), in the same logical axes
its weights use, so the rules table that lays out the weights also lays out the
activations: under `tensor` a `mlp` activation is split over `model`, under sequence
parallelism a `sequence` one is, and `batch` always follows the batch's mesh axes.

  Tensor        a tensor per example: logical axes, sizes, how many, and its bytes
                ("compute": the precision's compute dtype, or "float32")
  Collective    a tensor a block moves between devices when a logical axis is split:
                `all_reduce` (a contraction over a split axis: Megatron's row-parallel
                output), `all_to_all` (MoE's dispatch and combine over `expert`), or
                `all_gather` forward and `all_reduce` backward (context parallelism's
                keys and values over the mesh axis of `length`: each key block's
                gradient is summed over the devices' query chunks)
  Profile       the repeated blocks (what one keeps; its input, all that recomputation
                keeps; its collectives; its share of the model FLOPs) and what the step
                keeps outside them (embeddings, heads, the loss)

`transformer_block` and `conv_layers` build the tensors of the two families tfpod has.
They count what TensorFlow's gradient functions read back in the backward pass: the
inputs of matmuls and of layer norms, softmax outputs, activation-function inputs and
outputs, and dropout masks (a multiply by a float mask). Their constants were checked
against the CPU allocator's peak (bench/plan_accuracy.py, docs/benchmarks.md "Planner").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Tensor:
    """`count` tensors of these per-example logical axes and sizes (no batch dimension)."""

    axes: tuple
    shape: tuple
    count: float = 1.0
    dtype: str = "compute"
    when_split: str | None = None  # kept only when this logical axis is split (e.g. a one-hot lookup)
    whole_batch: bool = False  # every device holds it for the whole global batch (embedding tables' lookups)

    def elements(self) -> float:
        return self.count * math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Collective:
    """A tensor moved between devices when the logical axis `over` is split over a mesh axis.

    Attributes:
      tensor: the tensor per example (its axes lay it out).
      over: the logical axis whose mesh axis the devices exchange over.
      kind: "all_reduce", "all_to_all" or "all_gather" (the forward pass's).
      count: how many per forward pass (the backward pass moves as many).
      backward: the kind the backward pass moves (None: `kind`; an all-gather's gradient
        is a reduce-scatter).
    """

    tensor: Tensor
    over: str
    kind: str = "all_reduce"
    count: float = 1.0
    backward: str | None = None


@dataclasses.dataclass
class Profile:
    """A task's step per example, for the planner.

    Attributes:
      blocks: the repeated blocks (pipeline stages divide them; recomputation is per block).
      block_saved: what one block keeps for its backward pass.
      block_input: one block's input (all a recomputed block keeps).
      block_collectives: what one block moves between devices.
      block_flops_fraction: the blocks' share of the model FLOPs (recomputation repeats it).
      outside_saved: what the step keeps outside the blocks (embeddings, heads, loss).
      outside_collectives: what the step moves outside the blocks.
      tokens_per_example: tokens an example holds (1 for an image).
      ops_per_block, ops_outside: TensorFlow ops a forward pass runs (the backward
        runs about twice as many), for the per-op overhead.
      block_temporary: what one block's attention holds only while it runs (blockwise
        attention: one key block's scores), beside the backward's working set.
      causal_attention_share: the share of the model FLOPs that is causal self-attention's
        score and value matmuls, counted as the whole length x length matrix (PaLM's
        12 x layers x length x embed per token); context parallelism changes its work.
      causal_attention_work: the share of that whole matrix's work the attention runs
        without a `context` axis (blockwise: (G + 1) / 2G for G query groups; materialized:
        3/4, `fused.attention` skips a quarter); under `context` it is CONTEXT_ATTENTION_WORK.
      context_length: the sequence a `context` mesh axis splits (its causal attention
        gathers keys and values over it); 0: the task's attention cannot be split so.
      context_block: the local sequence (length / context) must be a whole number of these
        (blockwise attention's block; 1: any).
    """

    blocks: int
    block_saved: list = dataclasses.field(default_factory=list)
    block_input: Tensor | None = None
    block_collectives: list = dataclasses.field(default_factory=list)
    block_flops_fraction: float = 1.0
    outside_saved: list = dataclasses.field(default_factory=list)
    outside_collectives: list = dataclasses.field(default_factory=list)
    tokens_per_example: int = 1
    ops_per_block: int = 40
    ops_outside: int = 30
    block_temporary: list = dataclasses.field(default_factory=list)
    causal_attention_share: float = 0.0
    causal_attention_work: float = 1.0
    context_length: int = 0
    context_block: int = 1


def transformer_block(length: int, embed: int, heads: int, mlp: int, dropout: float = 0.0,
                      attention_dropout: float = 0.0, kv_length: int | None = None,
                      cross_length: int | None = None, sequence_axis: str = "sequence",
                      mlp_share: float = 1.0, blockwise: bool = False,
                      kv_heads: int | None = None) -> tuple[list, list]:
    """(saved tensors, collectives) of one pre- or post-norm Transformer block per example.

    Self-attention over `kv_length` keys (default: `length`), an optional cross
    attention over `cross_length` encoder positions, and an MLP of width `mlp` in
    `mlp_share` of the blocks (MoE blocks bring their own). `blockwise` self-attention
    (tfpod.attention; its dropout runs in the kernel) keeps each query's two row statistics
    (float32) instead of the [heads, length, keys] probabilities.

    Context parallelism (`length` split over a mesh axis, tfpod.partitioning.CONTEXT_AXIS):
    the queries stay split, the keys and values of the self-attention (`kv_heads` of them,
    logical axis `kv_heads`; None: `heads` as many as the queries) are all-gathered over the
    axis forward and their gradients reduce-scattered backward, and the gathered keys and
    values (the whole length) are kept for the backward beside the local ones. Both are
    tensors `when_split` on `length`: a plan without context has neither.
    """
    kv = embed // heads
    kv_length = kv_length or length
    stream = (sequence_axis, "embed")
    heads_t = ("length", "heads", "kv")

    def attention(keys: int, blocks: bool) -> list:
        probs = 1 + (2 if attention_dropout else 0)  # softmax output (+ mask and dropped probabilities)
        kept = [Tensor(stream, (length, embed), 2),  # layer norm input and output
                Tensor(heads_t, (length, heads, kv), 2),  # queries and the attention's output
                Tensor(heads_t, (keys, heads, kv), 2)]  # keys and values
        if blocks:  # the row statistics (max and sum) the blockwise backward recomputes the scores from
            return kept + [Tensor(("heads", "length", None), (heads, length, 1), 2, "float32")]
        return kept + [Tensor(("heads", "length", None), (heads, length, keys), probs)]

    saved = attention(kv_length, blockwise)  # (dropout runs in the kernel too)
    gathered = Tensor((None,) + _kv_axes(kv_heads), (kv_length, kv_heads or heads, kv), 2,
                      when_split="length")  # the whole length's keys and values
    saved.append(gathered)
    if cross_length:
        saved += attention(cross_length, False)
    saved += [Tensor(stream, (length, embed), 2),  # the MLP's layer norm input and output
              Tensor(("length", "mlp"), (length, mlp), 2 * mlp_share)]  # the activation's input and output
    if dropout:
        saved.append(Tensor(stream, (length, embed), 2 + (1 if cross_length else 0)))  # residual dropout masks
    contractions = 1 + mlp_share + (1 if cross_length else 0)  # attention output and MLP output: row-parallel
    collectives = [Collective(Tensor(stream, (length, embed)), "mlp", "all_reduce", contractions),
                   Collective(Tensor(("length",) + _kv_axes(kv_heads), (kv_length, kv_heads or heads, kv)),
                              "length", "all_gather", 2, backward="all_reduce")]  # keys, values over `context`
    return saved, collectives


def _kv_axes(kv_heads: int | None) -> tuple:
    """The logical axes of one position's keys (or values): grouped-query attention's own
    `kv_heads` (replicated where the tensor-parallel axis does not divide them), else `heads`."""
    return ("kv_heads" if kv_heads else "heads", "kv")


def blockwise_scores(rows: int, heads: int, block: int) -> Tensor:
    """The scores (float32) blockwise attention holds while it runs: one query group of `rows`
    against one key block, [heads, rows, block] (tfpod.attention.query_groups). Under context
    parallelism a group is one of a device's two chunks, length / 2C rows: at most a group's
    for C >= 2, so not split here."""
    return Tensor(("heads", None, None), (heads, rows, block), 1, "float32")


def lm_outside(length: int, embed: int, vocab: int, one_hot_lookup: bool) -> list:
    """What a language model keeps outside its blocks per example: the embedding's
    one-hot rows (when the lookup is a matmul), the final norm, and the logits' loss
    gradient (float32)."""
    saved = [Tensor(("sequence", "embed"), (length, embed), 3),  # embedding output, final norm in and out
             Tensor(("length", "vocab"), (length, vocab), 1, "float32")]  # the cross entropy's backprop
    if one_hot_lookup:  # a one-hot matmul lookup (split vocabulary rows) keeps the one-hot rows
        saved.append(Tensor(("length", "vocab"), (length, vocab), when_split="vocab"))
    return saved


def conv_layers(outputs: Sequence) -> list:
    """What a convolutional network keeps per example, from the (layer, output shape)
    pairs the planner's lazy build records (`tfpod.plan.lazy.recorded_build`): each
    convolution's output (its batch norm reads it back), each ReLU's (it reads its output
    back, and the next convolution its input), each pooling's and residual sum's. Batch
    norm outputs only feed the ReLU after them."""
    import tf_keras

    kinds = (tf_keras.layers.Conv2D, tf_keras.layers.Activation, tf_keras.layers.ReLU,
             tf_keras.layers.MaxPooling2D, tf_keras.layers.Add)
    return [Tensor(("height", None, None), tuple(shape[1:])) for layer, shape in outputs
            if isinstance(layer, kinds) and len(shape) == 4 and all(shape[1:])]


def total_elements(tensors: Sequence[Tensor]) -> float:
    return sum(t.elements() for t in tensors)
