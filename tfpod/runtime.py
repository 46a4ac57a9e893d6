"""Devices and the DTensor runtime: device-type detection, logical CPU split, system init.

Logical CPU devices can be configured only before the TensorFlow runtime starts, so
`initialize` must run before any op executes; a second call with other settings is
an error rather than a silent no-op.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError

log = logging.getLogger("tfpod")

DEVICE_TYPES = ("TPU", "GPU", "CPU")


@dataclasses.dataclass(frozen=True)
class RuntimeInfo:
    """What `initialize` set up.

    Attributes:
      device_type: "TPU", "GPU" or "CPU".
      num_local_devices: devices of that type on this host (logical CPUs included).
      num_global_devices: devices over all hosts.
      num_clients: hosts (DTensor clients) in the job.
      client_id: this host's index in [0, num_clients).
    """

    device_type: str
    num_local_devices: int
    num_global_devices: int
    num_clients: int
    client_id: int


_INFO: RuntimeInfo | None = None


def detect_device_type() -> str:
    """Returns the best device type present: TPU, then GPU, then CPU."""
    for kind in ("TPU", "GPU"):
        if tf.config.list_physical_devices(kind):
            return kind
    return "CPU"


def initialize(cpu_devices: int | None = None, device_type: str | None = None) -> RuntimeInfo:
    """Starts the DTensor accelerator system once for this process.

    Args:
      cpu_devices: split the host CPU into this many logical devices (CPU only;
        None keeps one device per physical CPU device).
      device_type: "TPU", "GPU" or "CPU"; None auto-detects (TPU, then GPU, then CPU).

    Returns:
      The RuntimeInfo of the started system.

    Raises:
      UserError: bad arguments, or a second call with different settings.
    """
    global _INFO
    device_type = (device_type or detect_device_type()).upper()
    if device_type not in DEVICE_TYPES:
        raise UserError(
            f"--device_type={device_type!r} is not a device type: use one of {', '.join(DEVICE_TYPES)} "
            "or leave it unset to auto-detect"
        )
    if cpu_devices is not None and cpu_devices < 1:
        raise UserError(f"--cpu_devices={cpu_devices} must be a positive number of logical CPU devices")
    if _INFO is not None:
        wanted_local = cpu_devices if (cpu_devices and device_type == "CPU") else _INFO.num_local_devices
        if _INFO.device_type != device_type or _INFO.num_local_devices != wanted_local:
            raise UserError(
                f"the runtime already runs {_INFO.num_local_devices} {_INFO.device_type} device(s); "
                f"asked for {wanted_local} {device_type}: logical devices are fixed once TensorFlow "
                "starts, so run the other configuration in a new process"
            )
        return _INFO
    if device_type == "CPU":
        physical = tf.config.list_physical_devices("CPU")
        if cpu_devices:
            tf.config.set_logical_device_configuration(
                physical[0], [tf.config.LogicalDeviceConfiguration()] * cpu_devices
            )
    if device_type == "GPU":
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
    kwargs = {}
    if device_type == "CPU" and cpu_devices:
        kwargs["num_logical_cpu_devices"] = cpu_devices
    dtensor.initialize_accelerator_system(device_type, **kwargs)
    local = len(dtensor.local_devices(device_type))
    _INFO = RuntimeInfo(
        device_type=device_type,
        num_local_devices=local,
        num_global_devices=dtensor.num_global_devices(device_type),
        num_clients=dtensor.num_clients(),
        client_id=dtensor.client_id(),
    )
    log.info(
        "runtime: %d %s device(s) on this host, %d in all, host %d of %d",
        _INFO.num_local_devices,
        device_type,
        _INFO.num_global_devices,
        _INFO.client_id,
        _INFO.num_clients,
    )
    return _INFO


def info() -> RuntimeInfo:
    """The RuntimeInfo of the started system; starts a default one if none runs."""
    return _INFO if _INFO is not None else initialize(
        cpu_devices=int(os.environ["TFPOD_CPU_DEVICES"]) if os.environ.get("TFPOD_CPU_DEVICES") else None
    )


def is_chief() -> bool:
    """True on host 0, the host that writes metrics, config and summaries."""
    return info().client_id == 0
