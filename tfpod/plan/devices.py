"""Device specs the planner predicts for: memory, peak FLOP/s, memory and link bandwidths.

Accelerators come from their data sheets (dense, per chip; the links per direction).
`cpu` is measured once per machine (tfpod.measured keeps it): this machine's large-matmul
peak, its memory bandwidth and its RAM, divided among the logical devices that share them
(tfpod splits one CPU into N logical devices for tests and laptops).

fp32 matmuls: TensorFlow runs them as TF32 on Ampere and Hopper GPUs by default
(`tf.config.experimental.enable_tensor_float_32_execution`), and with one bf16 pass on
TPUs (default precision), so `fp32_flops` is those rates, not the CUDA-core fp32 rate.

Sources: NVIDIA H100/H200/A100 data sheets (SXM; NVLink 900/600 GB/s both directions,
450/300 per direction; one 400/200 Gbit/s InfiniBand NIC per GPU); Google Cloud TPU v4
and v5p system architecture pages (ICI 2,400 and 4,800 Gbit/s per chip over 6 links,
of which a ring along one torus axis uses 2; a slice's hosts are joined by the same ICI).
"""

from __future__ import annotations

import dataclasses
import functools
import os

from tfpod import UserError

GB = 1e9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one logical CPU device) as the planner models it.

    Attributes:
      name: the table's key.
      memory_bytes: memory one device has for the run.
      bf16_flops, fp32_flops: dense matmul peak FLOP/s (fp32: see the module docstring).
      memory_bandwidth: bytes/s between the device and its memory.
      intra_host_bandwidth: bytes/s one device sends to another on its host (per direction).
      inter_host_bandwidth: bytes/s one device sends to a device on another host.
      devices_per_host: devices on one host (a mesh axis within them uses the intra-host link).
      matmul_efficiency: the fraction of peak large matmuls reach in a training step.
      collective_efficiency: the fraction of a link's bandwidth a collective reaches.
      op_overhead_s: fixed time per executed op (launch and DTensor's per-device dispatch).
    """

    name: str
    memory_bytes: float
    bf16_flops: float
    fp32_flops: float
    memory_bandwidth: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    devices_per_host: int
    matmul_efficiency: float = 0.6
    collective_efficiency: float = 0.8
    op_overhead_s: float = 5e-6

    def flops(self, precision: str) -> float:
        """Peak matmul FLOP/s at a train.precision ("float32" or "mixed_bfloat16")."""
        return self.bf16_flops if "bfloat16" in precision else self.fp32_flops

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 80 * GB, 989e12, 494e12, 3.35e12, 450 * GB, 50 * GB, 8),
    "h200": DeviceSpec("h200", 141 * GB, 989e12, 494e12, 4.8e12, 450 * GB, 50 * GB, 8),
    "a100-40g": DeviceSpec("a100-40g", 40 * GB, 312e12, 156e12, 1.555e12, 300 * GB, 25 * GB, 8),
    "a100-80g": DeviceSpec("a100-80g", 80 * GB, 312e12, 156e12, 2.039e12, 300 * GB, 25 * GB, 8),
    "tpu-v4": DeviceSpec("tpu-v4", 32 * GiB, 275e12, 275e12, 1.2e12, 100 * GB, 100 * GB, 4),
    "tpu-v5p": DeviceSpec("tpu-v5p", 95 * GB, 459e12, 459e12, 2.765e12, 200 * GB, 200 * GB, 4),
}


def names() -> list[str]:
    return sorted(DEVICES) + ["cpu"]


def memory_bandwidth() -> float:
    """Bytes/s of this machine's memory: the best of a few 256 MiB copies (read + write)."""
    import time

    import tensorflow as tf

    with tf.device("/device:CPU:0"):
        x = tf.random.stateless_uniform([64 * 2**20], seed=[1, 2])  # 256 MiB of fp32
        double = tf.function(lambda t: t * 2.0)
        double(x).numpy()
        best = float("inf")
        for _ in range(4):
            t = time.perf_counter()
            double(x)[0].numpy()
            best = min(best, time.perf_counter() - t)
    return 2 * x.shape[0] * 4 / best


def host_memory_bytes() -> float:
    """This machine's RAM (MemTotal), or the cgroup limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text.isdigit():
                total = min(total, int(text))
        except OSError:
            pass
    return float(total)


@functools.lru_cache(maxsize=None)
def measured_cpu() -> dict:
    """This CPU's matmul peaks (fp32, bf16), memory bandwidth and RAM, measured once per
    machine (tfpod.measured keeps them)."""
    from tfpod import flops, measured

    shapes = ((2048, 2048, 2048),)  # a few seconds; the efficiency constants below are relative to it
    peak = lambda dtype: measured.figure(f"planner peak {dtype} {shapes} repeats=2",
                                         lambda: flops.peak_matmul_flops(dtype, shapes, repeats=2))
    return {"fp32_flops": peak("float32"), "bf16_flops": peak("bfloat16"),
            "memory_bandwidth": measured.figure("memory bandwidth 256 MiB x2 best of 4", memory_bandwidth),
            "memory_bytes": host_memory_bytes()}


# Logical CPU devices, fitted to bench/presets.py's four presets (bench/plan_accuracy.py;
# docs/benchmarks.md "Planner"): the step's matmuls reach 0.7 of the large-matmul peak;
# a collective between logical devices (TensorFlow's CPU collectives: chunked copies and
# adds with a barrier per chunk) reaches a tenth of the memory bandwidth; and each op
# runs once per logical device, one after another on the same cores.
CPU_MATMUL_EFFICIENCY = 0.7
CPU_COLLECTIVE_EFFICIENCY = 0.1
CPU_OP_OVERHEAD_S = 40e-6


def cpu(devices_per_host: int, measured: dict | None = None) -> DeviceSpec:
    """This machine's CPU split into `devices_per_host` logical devices that share its
    cores, memory and memory bus (a copy between two of them is a memory copy)."""
    m = measured or measured_cpu()
    n = max(1, devices_per_host)
    return DeviceSpec("cpu", m["memory_bytes"] / n, m["bf16_flops"] / n, m["fp32_flops"] / n,
                      m["memory_bandwidth"] / n, m["memory_bandwidth"] / n, m["memory_bandwidth"] / n, n,
                      matmul_efficiency=CPU_MATMUL_EFFICIENCY, collective_efficiency=CPU_COLLECTIVE_EFFICIENCY,
                      op_overhead_s=CPU_OP_OVERHEAD_S * n)


def get(name: str, devices_per_host: int | None = None) -> DeviceSpec:
    """The spec of a device name (`cpu`: measured now), with its devices per host.

    Raises:
      UserError: an unknown name, or devices per host below 1.
    """
    key = name.lower().strip()
    if devices_per_host is not None and devices_per_host < 1:
        raise UserError(f"--plan_devices_per_host={devices_per_host} must be at least 1")
    if key == "cpu":
        return cpu(devices_per_host or 8)
    if key not in DEVICES:
        raise UserError(f"--plan_device={name!r} is not a known device: use one of {', '.join(names())}")
    spec = DEVICES[key]
    return dataclasses.replace(spec, devices_per_host=devices_per_host) if devices_per_host else spec
