"""Devices and the DTensor runtime: device-type detection, logical CPU split, system init.

Logical CPU devices can be configured only before the TensorFlow runtime starts, so
`initialize` must run before any op executes; a second call with other settings is
an error rather than a silent no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import re
from typing import Callable

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import GC_THRESHOLDS, UserError, compat, preemption

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


def configure_hosts(num_hosts: int | None, host_id: int | None, host_addresses: str | None) -> None:
    """Sets the standard DTensor multi-client environment from flags (flags win over env),
    else from a cluster manager's environment (tfpod.cluster: SLURM, Kubernetes).

    Args:
      num_hosts: DTENSOR_NUM_CLIENTS.
      host_id: DTENSOR_CLIENT_ID.
      host_addresses: DTENSOR_JOBS, comma-separated host:port of every host, in host order.
    """
    if num_hosts is None and host_id is None and host_addresses is None:
        from tfpod import cluster

        layout = cluster.from_environment()  # SLURM or Kubernetes, when no DTENSOR_* is set
        if layout is not None:
            cluster.apply(layout)
        return
    if num_hosts is None or host_id is None or host_addresses is None:
        raise UserError("multi-host flags go together: give --num_hosts, --host_id and --host_addresses (or none)")
    addresses = [a for a in host_addresses.split(",") if a]
    if len(addresses) != num_hosts or not 0 <= host_id < num_hosts:
        raise UserError(
            f"--host_addresses lists {len(addresses)} address(es) for --num_hosts={num_hosts} and --host_id={host_id}: "
            "give one host:port per host, and a host id in [0, num_hosts)"
        )
    os.environ.update({
        "DTENSOR_NUM_CLIENTS": str(num_hosts), "DTENSOR_CLIENT_ID": str(host_id),
        "DTENSOR_JOBS": ",".join(addresses), "DTENSOR_JOB_NAME": os.environ.get("DTENSOR_JOB_NAME", "worker"),
    })


def _share_cores(cpu_devices: int) -> None:
    """Gives each op of N logical CPU devices cores // N intra-op threads (at least 1).

    The N devices run their programs at the same time on the host's cores; with each op
    also spread over every core (TensorFlow's default), N x cores threads contend for the
    cores (bench/scaling.py measures the effect). $TF_NUM_INTRAOP_THREADS, when set, wins.
    """
    if os.environ.get("TF_NUM_INTRAOP_THREADS") or tf.config.threading.get_intra_op_parallelism_threads():
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // cpu_devices)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    log.info("runtime: %d intra-op thread(s) per op for %d logical CPU devices on %d core(s)", threads, cpu_devices, cores)


def initialize(cpu_devices: int | None = None, device_type: str | None = None) -> RuntimeInfo:
    """Starts the DTensor accelerator system once for this process.

    With DTENSOR_NUM_CLIENTS > 1 (set by tfpod.launch, a cluster manager, or
    `configure_hosts`) this process is one client of a multi-host job: the accelerator
    system connects to the other hosts over TensorFlow's gRPC runtime (NCCL collectives
    on GPUs, the TPU system on TPUs: DTensor's, untested here) with its coordination service
    watching them.

    Args:
      cpu_devices: split the host CPU into this many logical devices (CPU only; None:
        $TFPOD_CPU_DEVICES if set, else one device per physical CPU device).
      device_type: "TPU", "GPU" or "CPU"; None auto-detects (TPU, then GPU, then CPU).

    Returns:
      The RuntimeInfo of the started system.

    Raises:
      UserError: bad arguments, or a second call with different settings.
    """
    global _INFO
    # DTensor's pass that combines all-reduces moved the all-gather of updated weight
    # shards (an all-reduce on CPU) ahead of the optimizer update that produces them, so
    # weight-update sharding silently kept the old weights (TF 2.20). It is read once
    # per process, so it is turned off here, before the first function is compiled.
    os.environ.setdefault("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", "0")
    graph_optimizations = os.environ.get("TFPOD_GRAPH_OPTIMIZATIONS", "1")
    if graph_optimizations not in ("0", "1"):
        raise UserError(f"TFPOD_GRAPH_OPTIMIZATIONS={graph_optimizations!r}: use 1 (the default) or 0")
    cpu_devices, device_type = _requested(cpu_devices, device_type)
    if _INFO is not None:
        wanted_local = cpu_devices if (cpu_devices and device_type == "CPU") else _INFO.num_local_devices
        if _INFO.device_type != device_type or _INFO.num_local_devices != wanted_local:
            raise UserError(
                f"the runtime already runs {_INFO.num_local_devices} {_INFO.device_type} device(s); "
                f"asked for {wanted_local} {device_type}: logical devices are fixed once TensorFlow "
                "starts, so run the other configuration in a new process"
            )
        return _INFO
    _configure_devices(cpu_devices, device_type, graph_optimizations == "1")
    kwargs = {}
    if device_type == "CPU" and cpu_devices:
        kwargs["num_logical_cpu_devices"] = cpu_devices
    dtensor.initialize_accelerator_system(device_type, **kwargs)
    preemption.reinstall()  # TensorFlow's multi-client runtime took SIGTERM over in C++
    local = len(dtensor.local_devices(device_type))
    _INFO = RuntimeInfo(
        device_type=device_type,
        num_local_devices=local,
        num_global_devices=dtensor.num_global_devices(device_type),
        num_clients=dtensor.num_clients(),
        client_id=dtensor.client_id(),
    )
    settle_garbage_collector()
    compat.share_variable_handle_programs()
    log.info(
        "runtime: %d %s device(s) on this host, %d in all, host %d of %d",
        _INFO.num_local_devices,
        device_type,
        _INFO.num_global_devices,
        _INFO.client_id,
        _INFO.num_clients,
    )
    return _INFO


def _requested(cpu_devices: int | None, device_type: str | None) -> tuple[int | None, str]:
    """(logical CPU devices, device type) asked for: the arguments, else $TFPOD_CPU_DEVICES and
    auto-detection; checked."""
    if cpu_devices is None and os.environ.get("TFPOD_CPU_DEVICES"):
        cpu_devices = int(os.environ["TFPOD_CPU_DEVICES"])
    device_type = (device_type or detect_device_type()).upper()
    if device_type not in DEVICE_TYPES:
        raise UserError(
            f"--device_type={device_type!r} is not a device type: use one of {', '.join(DEVICE_TYPES)} "
            "or leave it unset to auto-detect"
        )
    if cpu_devices is not None and cpu_devices < 1:
        raise UserError(f"--cpu_devices={cpu_devices} must be a positive number of logical CPU devices")
    return cpu_devices, device_type


def _configure_devices(cpu_devices: int | None, device_type: str, graph_optimizations: bool) -> None:
    """What must be set before TensorFlow's runtime starts: graph optimizations, logical CPU
    devices and their threads, GPU memory growth and NCCL."""
    if not graph_optimizations:
        # Grappler off: functions compile faster and run slower; the same results. The test suite runs so
        # (conftest.py) apart from its production smoke run. Also the MLIR bridge (TF -> XLA), which no
        # step compiles with here but which walks every function's graph to find that out: 7% less CPU
        # for an in-process lm_tiny run (perf: MlirBridgePass::GetPassState).
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
        if device_type != "TPU":
            tf.config.experimental.disable_mlir_bridge()
    if device_type == "CPU":
        physical = tf.config.list_physical_devices("CPU")
        if cpu_devices:
            tf.config.set_logical_device_configuration(
                physical[0], [tf.config.LogicalDeviceConfiguration()] * cpu_devices
            )
        if cpu_devices and cpu_devices > 1:
            _share_cores(cpu_devices)
    if device_type == "GPU":
        os.environ.setdefault("DTENSOR_GPU_USE_NCCL_COMMUNICATION", "1")  # NCCL collectives across GPUs
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)



def settle_garbage_collector() -> None:
    """Tunes Python's cyclic garbage collector for a process that traces and compiles steps.

    Tracing a step builds and drops hundreds of thousands of Python objects (ops, tensors,
    Keras call contexts). With Python's defaults the collector then walks TensorFlow's
    own start-up objects (some 360,000, alive for the whole process) again and again: a
    tenth of a test run's CPU time (perf), 2.5 s of a 25 s run. The objects alive now are
    frozen (`gc.freeze`: no collection walks them again), and a young collection runs every
    50,000 allocations instead of 700. Memory is still collected: cycles made after start-up
    are freed by the next collections. (Megatron-LM's `--manual-gc` answers the same cost.)
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


LOST_HOST_ERRORS = (
    tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
    tf.errors.DeadlineExceededError, tf.errors.InternalError,
)


def lost_host_message(error: BaseException, checkpoint: str | None) -> str | None:
    """One line for a collective that failed because another host went away, else None.

    In a multi-host job the collective of a step fails within seconds when a peer's
    connection drops (the coordination service also times out silent peers); the
    error names the peer's task, which is its host id.
    """
    if info().num_clients < 2:
        return None
    text = error_text(error)
    tasks = sorted({int(t) for t in re.findall(r"/task:(\d+)", text)} - {info().client_id})
    cause = " ".join(text.strip().splitlines()[0].split())[:200] if text.strip() else type(error).__name__
    who = f"host {tasks[0]}" if tasks else "another host"
    return (
        f"lost {who} of {info().num_clients} ({cause}): host {info().client_id} stops too; the last complete "
        f"checkpoint ({checkpoint or 'none yet'}) is intact: relaunch the same command on every host to resume"
    )


def error_text(error: BaseException) -> str:
    """A TensorFlow error's message without its `{{function_node ...}}` prefixes."""
    return re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(error)).strip() or type(error).__name__


def error_cause(error: BaseException) -> str:
    """A TensorFlow error's first root cause that is not a cancellation ("4 root error(s) found"
    leads a list in which the others were cancelled by it), without function-node prefixes."""
    text = error_text(error)
    for code, message in re.findall(r"^\s*\(\d+\) ([A-Z_]+): (.*)$", text, re.M):
        if code != "CANCELLED":
            return message.strip()
    return text.strip().splitlines()[0]


@contextlib.contextmanager
def stop_on_lost_host(checkpoint: Callable[[], str | None]):
    """Within: an error of a collective that lost another host (in a step, the preemption
    agreement, an eval or a save) becomes one UserError line (`lost_host_message`).

    Args:
      checkpoint: returns the path of the last complete checkpoint, named in the line.
    """
    try:
        yield
    except LOST_HOST_ERRORS as e:
        message = lost_host_message(e, checkpoint())
        if message is None:
            raise
        raise UserError(message) from None


def to_host(x) -> np.ndarray:
    """A replicated DTensor (or a plain tensor) as a host numpy array."""
    try:
        return dtensor.unpack(x)[0].numpy()
    except (ValueError, TypeError, tf.errors.InvalidArgumentError):
        return np.asarray(x)


def describe_cpu() -> str:
    """This machine's CPU and TensorFlow's kernel path, in one line: the CPU model, whether it
    has AVX-512, whether oneDNN kernels are on (TensorFlow turns them on only with AVX-512-class
    features; TF_ENABLE_ONEDNN_OPTS=0 turns them off), and TensorFlow's version. Rounding and
    speed differ between the two paths, and some ops exist on one only."""
    from tfpod import compat

    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = " ".join(value.split())
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        import platform

        model = platform.processor() or model
    avx512 = "yes" if "avx512f" in flags else ("no" if flags else "unknown")
    onednn = "on" if compat.onednn_enabled() else "off"
    return (f"cpu: {model}, {os.cpu_count()} core(s); AVX-512 {avx512}; oneDNN {onednn} "
            f"(TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'unset')}); TensorFlow {tf.__version__}")


def info() -> RuntimeInfo:
    """The RuntimeInfo of the started system; starts a default one if none runs."""
    return _INFO if _INFO is not None else initialize()
