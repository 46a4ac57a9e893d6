"""A roofline model of one training step on a mesh of devices.

    step = (max(matmul FLOPs / (peak x efficiency), weight reads / bandwidth)
            + memory-bound passes / bandwidth) x (1 + pipeline bubble)
           + the optimizer's pass over its state / bandwidth
           + collectives (each one's bytes over the link its mesh axis crosses)
           + ops x per-op overhead

Matmul FLOPs are the task's model FLOPs (`Task.flops_per_token`), split evenly over the
devices, plus one more forward pass of the blocks under recomputation. Causal attention
counts the whole length x length matrix, as the model FLOPs do, except over a `context`
axis: the load-balanced split (each device holds chunks c and 2C-1-c of 2C; its first
half skips the second half of the keys) computes 3/4 of it (`CONTEXT_ATTENTION_WORK`). The memory-bound
passes are the activations written in the forward pass and read, with their
gradients, in the backward pass (3 passes), and the optimizer's read and write of the
weights, gradients and state. A ring all-reduce over n devices moves 2(n-1)/n of the
tensor per device, an all-gather, reduce-scatter or all-to-all (n-1)/n. A mesh axis
whose devices all sit on one host uses the host's link (NVLink, ICI), otherwise the
link between hosts. The pipeline bubble is (stages - 1) / microbatches of the compute.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from tfpod.plan.devices import DeviceSpec
from tfpod.plan.memory import tensor_bytes
from tfpod.plan.profile import Profile

# Passes over the activations in a step: written forward, read backward with their gradients.
ACTIVATION_PASSES = 3
# Passes over each weight's bytes in its matmuls: forward, input gradient, weight gradient.
WEIGHT_PASSES = 3
# Ops the optimizer runs per trainable variable (its fused update, the norm, the clip).
OPS_PER_VARIABLE = 8

# The work of causal attention split over a `context` axis, as a fraction of the whole
# length x length matrix (what the model FLOPs count): 1/2 x 1/2 + 1/2 x 1.
CONTEXT_ATTENTION_WORK = 0.75

FACTORS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0,
           "all_reduce+all_gather": 3.0}


def axis_bandwidths(axes: Sequence[tuple[str, int]], device: DeviceSpec, num_stages: int = 1) -> dict[str, float]:
    """{mesh axis: bytes/s a collective reaches per device along it}: the host's link when
    the axis's devices sit on one host (axes are major to minor; the last is fastest),
    else the link between hosts, times the device's collective efficiency. A pipeline
    stage holds devices_per_host / stages of each host."""
    per_host = max(1, device.devices_per_host // max(1, num_stages))
    out, stride = {}, 1
    for name, size in reversed(list(axes)):
        link = device.intra_host_bandwidth if stride * size <= per_host else device.inter_host_bandwidth
        out[name] = link * device.collective_efficiency
        stride *= size
    return out


def collective_seconds(kind: str, nbytes: float, n: int, bandwidth: float) -> float:
    """Seconds of one collective of `nbytes` per device over n devices."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return FACTORS[kind] * (n - 1) / n * nbytes / bandwidth


def step_time(*, device: DeviceSpec, precision: str, flops_per_step: float, num_devices: int, profile: Profile,
              remat: bool, table: Mapping, mesh, mesh_sizes: Mapping[str, int], bandwidths: Mapping[str, float],
              global_batch: int, state, activation_bytes: float, num_trainable: int, num_stages: int = 1,
              microbatches: int = 1, full_flops_per_step: float | None = None) -> dict:
    """Predicted seconds of one training step, and the terms behind it.

    Args:
      device: the device spec.
      precision: train.precision.
      flops_per_step: the model FLOPs of one step (forward and backward, all devices).
      num_devices: devices of the whole mesh (stages included).
      profile: the task's Profile.
      remat: recomputation of each block in the backward pass.
      table, mesh: the rules table and (one stage's) mesh, to lay out collectives' tensors.
      mesh_sizes: {mesh axis: size} of that mesh.
      bandwidths: {mesh axis: bytes/s} (`axis_bandwidths`).
      global_batch: examples per step.
      state: memory.StateBytes.
      activation_bytes: the activations a device keeps (all microbatches alive).
      num_trainable: trainable variables (the optimizer's ops).
      num_stages, microbatches: the pipeline.
      full_flops_per_step: the FLOPs of a step that trains every weight, whose forward third
        recomputation repeats (default flops_per_step; a LoRA step computes fewer gradients).
    """
    m = max(1, microbatches)
    recompute = profile.block_flops_fraction / 3.0 if remat else 0.0
    flops = flops_per_step + recompute * (full_flops_per_step or flops_per_step)
    context = mesh_sizes.get(table.get("length"), 1) if table.get("length") else 1
    # causal attention runs part of the whole matrix the model FLOPs count: the blocks it skips
    work = CONTEXT_ATTENTION_WORK if context > 1 else profile.causal_attention_work
    attention = profile.causal_attention_share * (full_flops_per_step or flops_per_step)
    flops -= (1 - work) * attention * (1 + (1 / 3 if remat else 0))
    flops /= num_devices
    peak = device.flops(precision) * device.matmul_efficiency
    matmul_s = flops / peak
    # (embedding tables are read and updated by rows: the task's profile counts those)
    dense = state.weights - state.sparse + state.optimizer - state.sparse_slots
    weight_reads_s = WEIGHT_PASSES * m * (state.weights - state.sparse + state.gathered) / device.memory_bandwidth
    activations_s = ACTIVATION_PASSES * activation_bytes / device.memory_bandwidth * (1 + recompute)
    optimizer_s = 2.0 * (dense + state.gradients) / device.memory_bandwidth
    compute_s = max(matmul_s, weight_reads_s) + activations_s
    bubble = (num_stages - 1) / m if num_stages > 1 else 0.0

    rows = global_batch // m
    blocks_here = math.ceil(profile.blocks / max(1, num_stages))
    comm = {}

    def add(name, seconds):
        if seconds > 0:
            comm[name] = comm.get(name, 0.0) + seconds

    for c, times in [(c, blocks_here * m) for c in profile.block_collectives] + \
                    [(c, m) for c in profile.outside_collectives]:
        axis = table.get(c.over)
        n = mesh_sizes.get(axis, 1) if axis else 1
        if n > 1:  # before the collective each device holds the whole tensor along `axis` (partial sums, the
            # tokens it sends, or what it gathers): sequence parallelism's reduce-scatter + all-gather move what an
            # all-reduce does
            whole = {k: (None if v == axis else v) for k, v in table.items()}
            nbytes = tensor_bytes(c.tensor, rows, whole, mesh, precision) * c.count
            for kind in (c.kind, c.backward or c.kind):  # forward, backward
                add(f"{kind} over {axis!r} (activations)", times * collective_seconds(kind, nbytes, n, bandwidths[axis]))
    for axis, nbytes, kind in state.gradient_sync:
        n = mesh_sizes.get(axis, 1)
        add(f"{kind} over {axis!r} (gradients)", collective_seconds(kind, nbytes, n, bandwidths.get(axis, 1.0)))
    if state.gathered:
        for axis, nbytes, kind in state.gradient_sync:
            if kind == "reduce_scatter":  # `2d`: the weights gathered forward and again backward
                n = mesh_sizes.get(axis, 1)
                add(f"all_gather over {axis!r} (weights)",
                    2 * m * collective_seconds("all_gather", state.gathered, n, bandwidths.get(axis, 1.0)))
    if num_stages > 1 and profile.block_input is not None:
        hop = tensor_bytes(profile.block_input, rows, table, mesh, precision) / device.intra_host_bandwidth
        add("stage copies", 2 * m * hop)
    ops = 3 * m * (blocks_here * profile.ops_per_block + profile.ops_outside) + OPS_PER_VARIABLE * num_trainable
    overhead_s = ops * device.op_overhead_s
    collectives_s = sum(comm.values())
    total = compute_s * (1 + bubble) + optimizer_s + collectives_s + overhead_s
    return {"step_time_s": total, "matmul_s": matmul_s, "weight_reads_s": weight_reads_s,
            "activation_passes_s": activations_s, "optimizer_s": optimizer_s, "compute_s": compute_s,
            "bubble_fraction": bubble / (1 + bubble) if bubble else 0.0, "bubble_s": compute_s * bubble,
            "collectives_s": collectives_s, "collectives": comm, "ops": ops, "op_overhead_s": overhead_s,
            "flops_per_device": flops}
