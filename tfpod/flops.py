"""Model FLOPs utilization: model FLOPs per second over the hardware's peak.

Peaks of known accelerators come from their data sheets (dense, per chip). A CPU has
no data sheet number, so its peak is measured once per process with a large matmul on
one device, which is the same yardstick bench/ uses.
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
    """FLOP/s of an n x n x n matmul on the first device of this process (best of repeats)."""
    with tf.device("/device:CPU:0"):
        a = tf.random.stateless_normal([n, n], seed=[1, 2], dtype=tf.float32)
        b = tf.random.stateless_normal([n, n], seed=[3, 4], dtype=tf.float32)
        a, b = tf.cast(a, dtype), tf.cast(b, dtype)
        mm = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y), tf.float32)))
        mm(a, b).numpy()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            mm(a, b).numpy()
            best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


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
