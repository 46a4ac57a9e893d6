"""The doctor's checks of the machine and the job: TensorFlow's build against the devices
asked for, the devices every host sees, the mesh, and a collective across every device.

Each check returns `Result`s (one line each); none raises for what it finds wrong.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.doctor.result import Result


# TensorFlow's build and the accelerators' software


def _loadable(name: str) -> str | None:
    """Where the shared library `name` loads from (the loader's path, or a pip `nvidia-*`
    package's lib folder, where TensorFlow's CUDA wheels put them), or None."""
    try:
        ctypes.CDLL(name)
        return name
    except OSError:
        pass
    for folder in sys.path:
        for path in glob.glob(os.path.join(folder, "nvidia", "*", "lib", name)):
            try:
                ctypes.CDLL(path)
                return path
            except OSError:
                continue
    return None


def nvidia_driver() -> str | None:
    """The NVIDIA driver found (nvidia-smi's GPUs and driver version, else libcuda's CUDA
    version), or None when there is none."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            rows = [r.strip() for r in out.stdout.splitlines() if r.strip()]
            if out.returncode == 0 and rows:
                return f"{len(rows)} GPU(s) by nvidia-smi: {rows[0]}"
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return "libcuda.so.1 (its version unreadable)"
    return f"libcuda.so.1, CUDA {version.value // 1000}.{version.value % 1000 // 10} driver"


def tensorflow_build(device_type: str | None) -> tuple[list[Result], bool]:
    """TensorFlow's version and build, the CPU's kernel path, and the accelerator asked for.

    Args:
      device_type: --device_type (None: auto-detect).

    Returns:
      (results, whether the devices asked for can start).
    """
    from tfpod import runtime

    build = tf.sysconfig.get_build_info()
    cuda, cudnn = build.get("cuda_version"), build.get("cudnn_version")
    kind = f"a CUDA {cuda} / cuDNN {cudnn} build" if build.get("is_cuda_build") else "a CPU-only build (no CUDA)"
    if build.get("is_rocm_build"):
        kind = "a ROCm build"
    results = [Result("ok", "tensorflow", f"{tf.__version__}, {kind}"),
               Result("ok", "cpu", runtime.describe_cpu().removeprefix("cpu: ").rsplit("; TensorFlow", 1)[0])]
    asked = (device_type or "").upper()
    if asked and asked not in runtime.DEVICE_TYPES:
        results.append(Result("FAIL", "device type", f"--device_type={device_type!r} is not a device type",
                              f"use one of {', '.join(runtime.DEVICE_TYPES)} or leave it unset to auto-detect"))
        return results, False
    gpus = tf.config.list_physical_devices("GPU")
    driver = nvidia_driver()
    libraries = {}
    if build.get("is_cuda_build"):
        major = str(cuda).split(".")[0]
        libraries = {f"libcudart.so.{major}": _loadable(f"libcudart.so.{major}"),
                     f"libcudnn.so.{cudnn}": _loadable(f"libcudnn.so.{cudnn}")}
    found = ", ".join(f"{n} {'loads' if p else 'missing'}" for n, p in libraries.items())
    if gpus:
        results.append(Result("ok", "gpu", f"{len(gpus)} GPU(s) TensorFlow can use; driver: {driver}; {found}"))
    elif asked == "GPU":
        if not build.get("is_cuda_build"):
            why, fix = "this TensorFlow is not built with CUDA", "pip install 'tensorflow[and-cuda]'"
        elif driver is None:
            why = "no NVIDIA driver found (no nvidia-smi, libcuda.so.1 does not load)"
            fix = f"run on a GPU machine with an NVIDIA driver for CUDA {cuda}, or pass --device_type=CPU"
        elif not all(libraries.values()):
            why = f"driver: {driver}, but {found}"
            fix = (f"pip install 'tensorflow[and-cuda]' (CUDA {cuda} and cuDNN {cudnn} libraries for this build), "
                   "or put them on LD_LIBRARY_PATH")
        else:
            why = f"driver: {driver}; {found}; yet TensorFlow lists no GPU"
            fix = f"check that the driver supports CUDA {cuda} (nvidia-smi names the highest it supports)"
        results.append(Result("FAIL", "gpu", f"--device_type=GPU asked, but {why}", fix))
        return results, False
    else:
        results.append(Result("ok", "gpu", f"none asked, none found (driver: {driver or 'none'}"
                                            f"{'; ' + found if found else ''}): the job runs on "
                                            f"{asked or runtime.detect_device_type()}"))
    if asked == "TPU" and not tf.config.list_physical_devices("TPU"):
        results.append(Result("FAIL", "tpu", "--device_type=TPU asked, but TensorFlow finds no TPU",
                              "run on a TPU VM with TensorFlow's TPU build, or pass another --device_type"))
        return results, False
    return results, True


# Devices, hosts and the mesh


def host_mesh(device_type: str) -> dtensor.Mesh | None:
    """A mesh of one device of each host (None: one host): hosts can compare values on it even
    when they see different numbers of devices (a mesh over all of them then fails to form)."""
    from tfpod import runtime

    info = runtime.info()
    if info.num_clients == 1:
        return None
    local = dtensor.local_devices(device_type)[:1]
    return dtensor.create_distributed_mesh([("hosts", info.num_clients)], local_devices=local,
                                           device_type=device_type)


def per_host(value: float, mesh: dtensor.Mesh | None) -> list[float]:
    """Every host's `value`, in host order (a max over a one-hot row: exact for integers below 2**24)."""
    from tfpod import mesh as meshlib, runtime

    info = runtime.info()
    if info.num_clients == 1:
        return [value]
    row = [0.0] * info.num_clients
    row[info.client_id] = float(value) + 1  # + 1: a host that sees 0 still shows
    return [v - 1 for v in meshlib.host_max(row, mesh)]


def devices(cpu_devices: int | None, device_type: str | None):
    """Starts the runtime and compares the devices every host sees.

    Returns:
      (results, the RuntimeInfo or None when it did not start or the hosts disagree, the host mesh or None).
    """
    from tfpod import runtime

    try:
        info = runtime.initialize(cpu_devices=cpu_devices, device_type=device_type)
    except UserError as e:
        return [Result("FAIL", "devices", str(e))], None, None
    except (tf.errors.OpError, RuntimeError, ValueError) as e:
        return [Result("FAIL", "devices", f"the {device_type or 'default'} runtime did not start "
                                          f"({runtime.error_cause(e)})",
                       "run python -m tfpod.doctor -v 1 for TensorFlow's log")], None, None
    mesh = host_mesh(info.device_type)
    counts = [int(c) for c in per_host(info.num_local_devices, mesh)]
    what = f"{info.num_local_devices} {info.device_type} device(s) on this host"
    if len(set(counts)) > 1:
        seen = ", ".join(f"host {h}: {c}" for h, c in enumerate(counts))
        return [Result("FAIL", "devices", f"{what}, but the hosts see different counts ({seen})",
                       "give every host the same devices: the same --cpu_devices (or $TFPOD_CPU_DEVICES), the "
                       "same accelerators visible (CUDA_VISIBLE_DEVICES)")], None, mesh
    if info.num_clients > 1:
        what += f"; every host of {info.num_clients} the same ({info.num_global_devices} in all)"
    return [Result("ok", "devices", what)], info, mesh


def mesh_fit(spec: str | None, preset: str | None, info) -> Result:
    """Whether the mesh spec (--mesh, else experiment.mesh) covers the job's devices."""
    from tfpod import mesh as meshlib

    if spec == "auto" or preset == "auto":
        return Result("ok", "mesh", f"auto: the planner picks a layout of the {info.num_global_devices} devices")
    try:
        axes = meshlib.parse_mesh_spec(spec, info.num_global_devices)
    except UserError as e:
        return Result("FAIL", "mesh", str(e))
    resolved = ",".join(f"{n}:{s}" for n, s in axes)
    return Result("ok", "mesh", f"{spec}{'' if resolved == spec else ' -> ' + resolved} on the job's "
                                f"{info.num_global_devices} {info.device_type} devices")


# The collective


@tf.function(autograph=False)
def _sum_over_devices(x):
    return tf.reduce_sum(x, axis=0)


def _all_reduce(mesh: dtensor.Mesh, rows_of_device) -> tuple[list[np.ndarray], object]:
    """Sums a [devices, n] tensor whose row g device g holds: each local device's copy of the sum."""
    layout = dtensor.Layout([mesh.dim_names[0], dtensor.UNSHARDED], mesh)
    x = dtensor.pack([rows_of_device(g) for g in mesh.local_device_ids()], layout)
    y = _sum_over_devices(x)
    return [t.numpy() for t in dtensor.unpack(y)], x


def _cause(error: BaseException, client_id: int) -> str:
    """A collective's error in one line: the hosts it names, its root cause without repeated
    abort prefixes."""
    from tfpod import runtime

    text = re.sub(r"(Collective ops is aborted by: )+", "", " ".join(runtime.error_cause(error).split()))[:400]
    others = sorted({int(t) for t in re.findall(r"/task:(\d+)", runtime.error_text(error))} - {client_id})
    return (f"host {', '.join(map(str, others))}: " if others else "") + text


KNOWN_WIDTH = 8  # elements of the known-values all-reduce


def known_row(g: int) -> list[float]:
    """What device g contributes to the known-values all-reduce: [g, g + 1, ..., g + 7]."""
    return [float(g + i) for i in range(KNOWN_WIDTH)]


def check_sums(sums, n: int, hosts: int) -> Result:
    """The known-values all-reduce's result on each local device against the known sum:
    element i is N(N-1)/2 + N*i for N devices (float32: exact below 2**24)."""
    want = np.array([n * (n - 1) / 2 + n * i for i in range(KNOWN_WIDTH)], np.float32)
    wrong = [k for k, s in enumerate(sums) if not np.array_equal(np.asarray(s), want)]
    if wrong:
        return Result("FAIL", "collective", f"an all-reduce of known values over {n} devices gave "
                                            f"{np.asarray(sums[wrong[0]]).tolist()} on local device {wrong[0]}, not "
                                            f"{want.tolist()}", "the devices or their links corrupt data: run the "
                                                                "doctor again, then take the host out of the job")
    return Result("ok", "collective", f"all-reduce of known values over {n} devices of {hosts} host(s): exact")


def collective(info, bandwidth_bytes: int, repeats: int = 5) -> list[Result]:
    """An all-reduce over every device of every host with known values (`known_row`,
    `check_sums`), and its bandwidth with `bandwidth_bytes` per device (0: not measured):
    NCCL's bus bandwidth, bytes * 2(N-1)/N / time, what each device's links carry in a
    ring all-reduce.
    """
    from tfpod import mesh as meshlib, runtime

    n = info.num_global_devices
    try:
        mesh = meshlib.make_mesh("devices:-1", info.device_type)
        sums, _ = _all_reduce(mesh, lambda g: tf.constant([known_row(g)], tf.float32))
        results = [check_sums(sums, n, info.num_clients)]
        if bandwidth_bytes and not results[0].failed:
            elements = max(1, bandwidth_bytes // 4)
            big = tf.ones([1, elements], tf.float32)
            _, x = _all_reduce(mesh, lambda g: big)  # traced and run once: not timed
            start = time.perf_counter()
            for _ in range(repeats):
                y = _sum_over_devices(x)
            dtensor.unpack(y)[0].numpy()
            seconds = (time.perf_counter() - start) / repeats
            bus = elements * 4 * 2 * (n - 1) / max(n, 1) / seconds / 1e9
            results.append(Result("ok", "bandwidth", f"all-reduce of {elements * 4 / 2**20:.0f} MiB per device over "
                                                     f"{n} devices: {seconds * 1e3:.1f} ms, {bus:.2f} GB/s bus "
                                                     "bandwidth"))
        return results
    except (tf.errors.OpError, RuntimeError) as e:
        return [Result("FAIL", "collective", f"an all-reduce over {n} devices of {info.num_clients} host(s) failed "
                                             f"({_cause(e, info.client_id)})",
                       "run every host with the same flags and --host_addresses, check that each host reaches the "
                       "others on those ports, and that none stopped (its own lines say why)")]
