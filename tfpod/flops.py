"""Model FLOPs utilization: model FLOPs per second over the hardware's peak.

Peaks of known accelerators come from their data sheets (dense, per chip). A CPU has
no data sheet number, so its peak is measured with a large matmul on one device, which
is the same yardstick bench/ uses, once per machine (tfpod.measured keeps it).
"""

from __future__ import annotations

import functools
import time

import tensorflow as tf

# Dense peak FLOP/s per chip, by a substring of the device name.
_DATASHEET = {
    "bfloat16": {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "V100": 125e12, "TPU v5": 197e12, "TPU v4": 275e12, "TPU v3": 123e12},
    "float32": {"H200": 67e12, "H100": 67e12, "A100": 19.5e12, "L4": 30e12, "V100": 15.7e12, "TPU v5": 197e12, "TPU v4": 275e12, "TPU v3": 123e12},
}


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(dtype: str = "float32", n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul on the first device of this process (best of repeats).

    The quick figure the trainer logs MFU against on a CPU, measured once per machine
    (tfpod.measured keeps it); `peak_matmul_flops` is the thorough one the benchmarks use.
    """
    from tfpod import measured

    return measured.figure(f"matmul {dtype} n={n} repeats={repeats}",
                           lambda: matmul_flops(dtype, (n, n, n), per_call=1, repeats=repeats))


def matmul_flops(dtype: str, shape: tuple[int, int, int], per_call: int = 1, repeats: int = 3) -> float:
    """Best FLOP/s of `per_call` independent [m, k] x [k, n] matmuls in one compiled call.

    Args:
      dtype: "float32" or "bfloat16".
      shape: (m, k, n).
      per_call: matmuls per call (amortizes the call and the result's reduction).
      repeats: timed calls after one warm-up call; the fastest counts.
    """
    m, k, n = shape
    with tf.device("/device:CPU:0"):
        a = [tf.cast(tf.random.stateless_normal([m, k], seed=[1, i]), dtype) for i in range(per_call)]
        b = tf.cast(tf.random.stateless_normal([k, n], seed=[3, 4]), dtype)
        mm = tf.function(lambda a, b: tf.add_n([tf.cast(tf.matmul(x, b)[0, 0], tf.float32) for x in a]))
        mm(a, b).numpy()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            mm(a, b).numpy()
            best = min(best, time.perf_counter() - t)
    return 2.0 * m * k * n * per_call / best


# (m, k, n) of the matmuls the peak is the best of: squares, and GPT's output layer
# (4096 tokens x 768 wide x 50304 vocab), which runs faster than any square here.
PEAK_SHAPES = ((2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (4096, 768, 50304))


def peak_matmul_flops(dtype: str = "float32", shapes=PEAK_SHAPES, repeats: int = 5) -> float:
    """This machine's large-matmul peak FLOP/s: the best over `shapes`.

    Each shape runs enough matmuls per call for about 2e11 FLOPs, so the call itself is
    not measured.
    """
    best = 0.0
    for m, k, n in shapes:
        per_call = max(1, round(2e11 / (2.0 * m * k * n)))
        best = max(best, matmul_flops(dtype, (m, k, n), per_call, repeats))
    return best


def peak_flops_per_device(device_type: str, dtype: str = "float32") -> float:
    """Peak FLOP/s of one device of this type: data sheet for accelerators, measured for CPU."""
    if device_type in ("GPU", "TPU"):
        devices = tf.config.list_logical_devices(device_type)
        details = tf.config.experimental.get_device_details(tf.config.list_physical_devices(device_type)[0]) if devices else {}
        name = details.get("device_name", "")
        for key, value in _DATASHEET.get(dtype, _DATASHEET["float32"]).items():
            if key in name:
                return value
    return measured_matmul_flops(dtype)


def mfu(model_flops_per_sec: float, peak_total: float) -> float:
    """Model FLOPs utilization in [0, 1] (0 when the peak is unknown)."""
    return model_flops_per_sec / peak_total if peak_total > 0 else 0.0
