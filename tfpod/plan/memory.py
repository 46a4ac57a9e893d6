"""Per-device bytes of a run: weights, gradients, optimizer state, activations, temporaries.

Weights, gradients and optimizer state are exact: they come from the same layouts the
trainer builds (`partitioning.resolve` over the rules), so they equal layouts.txt.
Activations and temporaries are a model: the task's Profile laid out by the same rules
table, times the blocks a device holds and the microbatches alive at once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Collection, Mapping, Sequence

from tensorflow.experimental import dtensor

from tfpod.partitioning import layout_for, update_layout
from tfpod.partitioning.build import compute_layout
from tfpod.partitioning.report import bytes_per_device
from tfpod.plan.profile import Profile, Tensor

# Optimizer slots per trainable weight (each the weight's shape and dtype).
SLOTS = {"adamw": 2, "lamb": 2, "lars": 1, "sgd": 1, "adagrad": 1}


def slots(optimizer_config) -> int:
    if optimizer_config.name == "sgd" and not optimizer_config.momentum:
        return 0
    return SLOTS[optimizer_config.name]


@dataclasses.dataclass
class StateBytes:
    """Per-device bytes of the state that lives across steps, for the largest stage."""

    weights: int
    gradients: int
    optimizer: int
    gathered: int  # `2d`: the weights a step holds gathered over the gather axis
    weight_bytes_total: int  # all devices' copies of the weights together (one model's bytes x replicas)
    gradient_sync: list  # [(mesh axis, bytes per device all-reduced over it, kind)]
    sparse: int = 0  # of `weights`: embedding tables', which a step reads and updates by rows only
    sparse_slots: int = 0  # of `optimizer`: the tables' slots


def state_bytes(specs: Sequence, layouts: Mapping[str, dtensor.Layout], stage_of: Mapping[str, int],
                num_stages: int, optimizer_config, update_axis: str | None, gather_axis: str | None,
                batch_mesh_axes: Sequence[str], sparse: Collection[str] = ()) -> StateBytes:
    """Weights, gradients and optimizer state per device (the largest stage's), exactly as
    the trainer lays them out; and the gradient traffic those layouts imply.

    `sparse`: the embedding tables (tfpod.embedding): their weights and slots are held as
    laid out, but their gradient is rows (the task's profile counts them), not a dense
    tensor, and they are synchronized by their lookups' collectives, not all-reduced."""
    n_slots = slots(optimizer_config)
    per_stage = [[0, 0, 0, 0] for _ in range(max(1, num_stages))]
    sync: dict[tuple, int] = {}
    total = sparse_weights = sparse_slots = 0
    for s in specs:
        layout = layouts[s.name]
        here = per_stage[stage_of.get(s.name, 0)]
        w = bytes_per_device(s.shape, s.dtype, layout)
        here[0] += w
        total += w
        if not s.trainable:
            continue
        if s.name in sparse:
            here[2] += n_slots * w
            sparse_weights, sparse_slots = sparse_weights + w, sparse_slots + n_slots * w
            continue
        here[1] += w  # the gradient, in the weight's layout and dtype
        target = update_layout(layout, s.shape, update_axis)
        state = bytes_per_device(s.shape, s.dtype, target)
        here[2] += n_slots * state + (state if target != layout else 0)  # slots (+ the sharded working copy)
        if gather_axis and gather_axis in layout.sharding_specs:
            here[3] += bytes_per_device(s.shape, s.dtype, compute_layout(layout, gather_axis))
        for axis in batch_mesh_axes:  # replicas of the weight along a batch axis sum their gradients
            if axis in layout.sharding_specs:
                kind = "reduce_scatter"  # `2d`: the gradient returns to the data-sharded weight
            elif target != layout and axis in target.sharding_specs:
                # weight-update sharding: the gradient of the replicated weight is all-reduced
                # (DTensor sums it into the weight's own layout), sliced to the update's shard,
                # and the updated shards are all-gathered back
                kind = "all_reduce+all_gather"
            else:
                kind = "all_reduce"
            size = bytes_per_device(s.shape, s.dtype, compute_layout(layout, axis))
            sync[(axis, kind)] = sync.get((axis, kind), 0) + size
    largest = max(per_stage, key=lambda b: sum(b))
    return StateBytes(*largest, total, [(a, b, k) for (a, k), b in sorted(sync.items())], sparse_weights,
                      sparse_slots)


def element_bytes(dtype: str, precision: str) -> int:
    return 4 if dtype == "float32" or "bfloat16" not in precision else 2


def tensor_bytes(t: Tensor, rows: int, table: Mapping, mesh: dtensor.Mesh, precision: str) -> float:
    """Bytes one device holds of `rows` examples of t (the batch split like the batch)."""
    if t.when_split and not (table.get(t.when_split) in mesh.dim_names and mesh.dim_size(table[t.when_split]) > 1):
        return 0.0
    layout = layout_for(((None,) if t.whole_batch else ("batch",)) + tuple(t.axes), table, mesh,
                        (rows,) + tuple(t.shape))
    local = [math.ceil(d / (1 if spec == dtensor.UNSHARDED else mesh.dim_size(spec)))
             for d, spec in zip((rows,) + tuple(t.shape), layout.sharding_specs)]
    return t.count * math.prod(local) * element_bytes(t.dtype, precision)


@dataclasses.dataclass
class ActivationBytes:
    activations: float
    temporary: float
    breakdown: dict


def in_flight(num_stages: int, microbatches: int, schedule: str) -> int:
    """Microbatches whose activations the first stage holds at once."""
    if num_stages <= 1:
        return 1
    return microbatches if schedule == "gpipe" else min(num_stages, microbatches)


def activation_bytes(profile: Profile, global_batch: int, table: Mapping, mesh: dtensor.Mesh, precision: str,
                     remat: bool, num_stages: int = 1, microbatches: int = 1, schedule: str = "gpipe",
                     gradients: int = 0, gathered: int = 0) -> ActivationBytes:
    """Activations a device keeps for the backward pass, and the step's temporaries.

    Args:
      profile: the task's.
      global_batch: examples per step.
      table, mesh: the rules table and (one stage's) mesh.
      precision: train.precision.
      remat: whether each block is recomputed in the backward pass (keeps its input only).
      num_stages, microbatches, schedule: the pipeline (or gradient accumulation).
      gradients: the per-device gradient bytes (accumulated over microbatches).
      gathered: `2d`'s gathered weights.
    """
    rows = global_batch // max(1, microbatches)
    size = lambda ts: sum(tensor_bytes(t, rows, table, mesh, precision) for t in ts)
    alive = in_flight(num_stages, microbatches, schedule)
    blocks_here = math.ceil(profile.blocks / max(1, num_stages))
    one_block = size(profile.block_saved)
    kept_per_block = size([profile.block_input]) if remat and profile.block_input else one_block
    blocks = blocks_here * alive * kept_per_block
    outside = size(profile.outside_saved) * alive
    recompute = one_block if remat else 0.0
    largest_outside = max((tensor_bytes(t, rows, table, mesh, precision) / max(t.count, 1)
                           for t in profile.outside_saved), default=0.0)
    # While a block's backward runs, its activations' gradients are alive beside them (and
    # its attention's scores of one key block, blockwise), and the loss's gradient beside
    # the head's outputs.
    scores = size(profile.block_temporary)
    working = max(one_block + scores, largest_outside)
    accumulated = gradients if microbatches > 1 else 0
    # `2d`'s gathered weights are kept for the backward pass in the compute dtype: every
    # block's, or with recomputation only the block being recomputed.
    gathered = gathered * element_bytes("compute", precision) / 4 / (profile.blocks if remat and profile.blocks else 1)
    breakdown = {"blocks": blocks, "outside_blocks": outside, "recomputed_block": recompute,
                 "backward_working_set": working, "attention_scores": scores, "gathered_weights": gathered,
                 "gradient_accumulators": accumulated, "microbatches_alive": alive,
                 "blocks_per_device": blocks_here, "block_bytes": one_block, "microbatch_rows": rows}
    return ActivationBytes(blocks + outside + recompute, working + gathered + accumulated, breakdown)


def checkpoint_bytes(specs: Sequence, optimizer_config, adapters_only: bool = False) -> int:
    """Bytes of one checkpoint on disk (tfpod.train_state: the weights and the optimizer's
    slots; weight-update sharding's working copies are not saved), over all devices.

    Args:
      specs: the model's VarSpecs.
      optimizer_config: the optimizer (its slots per trainable weight).
      adapters_only: a LoRA run: its checkpoints hold the trained adapters alone (the frozen
        base is read from its own checkpoint).
    """
    trained = sum(math.prod(s.shape) * s.dtype.size for s in specs if s.trainable)
    frozen = 0 if adapters_only else sum(math.prod(s.shape) * s.dtype.size for s in specs if not s.trainable)
    return trained * (1 + slots(optimizer_config)) + frozen
