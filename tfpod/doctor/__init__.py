"""The preflight: `python -m tfpod.doctor` checks the machine, the hosts and the run's files
before a job, one line per check; main.py runs its fast subset before every train or eval run.

    python -m tfpod.doctor --gin_file=gin/lm_tiny.gin --model_dir=runs/lm_tiny [--mesh=...] [--cpu_devices=8]
    python -m tfpod.launch --num_hosts=2 --devices_per_host=4 -- python -m tfpod.doctor --gin_file=... --model_dir=D

It takes main.py's flags (those that matter: --gin_file, --gin_param, --model_dir, --mode,
--mesh, --cpu_devices, --device_type, --num_hosts/--host_id/--host_addresses). The checks:

  tensorflow   its version and build (the CUDA/cuDNN it was built for), the CPU and its
               kernel path (oneDNN on or off), the GPU driver and CUDA libraries found; a
               device type asked for that the build or the machine cannot give fails
  devices      the devices this host sees; every host the same count (compared on a mesh
               of one device per host, which forms even when the counts differ)
  mesh         --mesh (else experiment.mesh) covers the job's devices
  collective   an all-reduce over every device of every host with known values, checked
               exactly; and its bus bandwidth with --bandwidth_mb per device
  model_dir    writable; write speed (--write_mb written and fsynced); free space for
               train.keep_checkpoints + 1 checkpoints of the size the planner predicts
  input        this host's files of each data pattern match, and the start of each reads

Each line is `ok   <check>: <found>` or `FAIL <check>: <what is wrong>; <how to fix>`
(also `warn`, and `skip` when an earlier failure leaves nothing to check). With several
hosts, every host prints its own lines; the hosts then agree, and every host exits 1 when
any host failed a check (0 when all passed).

The fast subset (`preflight`, main.py's --preflight, on by default; --nopreflight skips it)
runs before anything is written: the build against the device asked for, devices and mesh,
model_dir writable with room for the predicted checkpoints (no write-speed probe), and the
input files; no bandwidth. When all pass it logs one line; else the run stops with one
`error:` line, the failed check's message.
"""

from __future__ import annotations

import logging
import os
import time

from tfpod import UserError
from tfpod.doctor.result import Result

log = logging.getLogger("tfpod")

PREFLIGHT_MODES = ("train", "train_and_eval", "eval")
WRITING_MODES = ("train", "train_and_eval")


def _checkpoint(configs) -> tuple[int, int] | str:
    """(bytes, parameters) of one checkpoint as the planner predicts, or why it cannot."""
    from tfpod import plan

    try:
        return plan.predict_checkpoint_bytes(configs)
    except UserError as e:
        return str(e)


def run_checks(configs, config_error: str | None, model_dir: str | None, mode: str, mesh_spec: str | None,
               cpu_devices: int | None, device_type: str | None, bandwidth_bytes: int, write_bytes: int,
               fast: bool = False, emit=None) -> list[Result]:
    """Every check in order (the fast subset with `fast`: no collective, a one-byte write
    probe, the start of at most storage.FAST_INPUT_FILES files per pattern).

    Args:
      configs: api.RunConfigs, or None when the config did not build (`config_error` says why).
      model_dir, mode, mesh_spec, cpu_devices, device_type: main.py's flags.
      bandwidth_bytes: per device, for the collective's bandwidth (0: not measured).
      write_bytes: the model_dir write-speed probe's size.
      emit: called with each Result as it is known (the doctor prints them at once).

    Returns:
      Every Result; with several hosts, ending with the hosts' agreement (`hosts`).
    """
    from tfpod.doctor import checks, storage

    results: list[Result] = []

    def add(found: list[Result]) -> None:
        for r in found:
            results.append(r)
            if emit is not None:
                emit(r)

    if not fast:
        add(([Result("FAIL", "config", config_error)] if config_error else
             [Result("ok", "config", f"{configs.task.name}, {configs.train.steps} steps, global batch "
                                     f"{configs.train.global_batch_size}")]))
    built, usable = checks.tensorflow_build(device_type)
    add(built)
    info = mesh = None
    if usable:
        found, info, mesh = checks.devices(cpu_devices, device_type)
        add(found)
    if info is None:
        add([Result("skip", c, "needs the devices (above)") for c in ("mesh",) + (() if fast else ("collective",))])
    else:
        if configs is not None:
            add([checks.mesh_fit(mesh_spec or configs.experiment.mesh, configs.sharding.preset, info)])
        if not fast:
            add(checks.collective(info, bandwidth_bytes))
    num_hosts, host_id = (info.num_clients, info.client_id) if info is not None else _hosts()
    if configs is not None:
        if not model_dir and not fast:
            add([Result("skip", "model_dir", "no --model_dir given: its space and speed are not checked")])
        if model_dir and mode in WRITING_MODES:
            add(storage.model_dir_checks(model_dir, _checkpoint(configs), configs.train.keep_checkpoints,
                                         write_bytes, host_id, keep_folders=fast))
        add(storage.input_checks(configs, mode, num_hosts, host_id,
                                 storage.FAST_INPUT_FILES if fast else None))
    if mesh is not None and not fast:
        broken = any(r.failed and r.check == "collective" for r in results)  # TensorFlow's collectives are down
        add([Result("skip", "hosts", "no comparison with the other hosts after the failed collective") if broken
             else _agree(results, mesh, num_hosts)])
    return results


def _hosts() -> tuple[int, int]:
    return int(os.environ.get("DTENSOR_NUM_CLIENTS", "1")), int(os.environ.get("DTENSOR_CLIENT_ID", "0"))


def _agree(results: list[Result], mesh, num_hosts: int) -> Result:
    """Every host's failures, compared on the host mesh: which hosts failed a check."""
    from tfpod.doctor import checks

    import tensorflow as tf

    try:
        failed = checks.per_host(sum(r.failed for r in results), mesh)
    except (tf.errors.OpError, RuntimeError) as e:
        return Result("FAIL", "hosts", f"could not compare with the other hosts ({type(e).__name__})",
                      "run the doctor on every host at once, with the same flags and --host_addresses")
    bad = [f"host {h} ({int(n)})" for h, n in enumerate(failed) if n]
    if bad:
        return Result("FAIL", "hosts", f"failed checks on {', '.join(bad)} of {num_hosts}",
                      "fix what each host's FAIL lines name, then run the doctor again")
    return Result("ok", "hosts", f"all {num_hosts} hosts passed every check")


def leave_together(num_hosts: int, timeout_s: float = 10.0) -> None:
    """With several hosts: returns once every host has got here, or after `timeout_s`
    (a host that died, or whose runtime never started). TensorFlow's collectives pull a
    peer's buffer, so a host that exits right after the last comparison can leave another
    still reading from it ("could not compare ... (UnavailableError)", seen under load)."""
    if num_hosts <= 1:
        return
    from tensorflow.python.eager import context

    try:
        context.context().wait_at_barrier("tfpod_doctor_done", int(timeout_s * 1000))
    except Exception:  # noqa: BLE001  (no coordination service, a dead peer, the timeout: leave anyway)
        pass


def preflight(configs, model_dir: str, mode: str, options) -> None:
    """main.py's fast subset before a train or eval run (api.run's `check`): one log line
    when every check passes, else a UserError with the first failure's message (nothing
    written yet).

    Args:
      configs: api.RunConfigs.
      model_dir: --model_dir.
      mode: --mode (other modes than PREFLIGHT_MODES are not checked).
      options: api.RunOptions.
    """
    if mode not in PREFLIGHT_MODES or options.mesh is not None:
        return
    from tfpod.doctor import storage

    start = time.perf_counter()
    created = storage.missing_folders(model_dir)  # the write probe makes them, and keeps them for the run
    known = {}  # check -> when its result was known
    results = run_checks(configs, None, model_dir, mode, options.mesh_spec, options.cpu_devices, options.device_type,
                         bandwidth_bytes=0, write_bytes=0, fast=True,
                         emit=lambda r: known.setdefault(r.check, time.perf_counter()))
    failed = [r for r in results if r.failed]
    if failed:
        storage.remove_empty(created)  # the run stops: the folders the write probe made go again
        more = f" (and {len(failed) - 1} more: python -m tfpod.doctor lists them)" if len(failed) > 1 else ""
        raise UserError(failed[0].message() + more)
    runtime_ms = (known["devices"] - known["gpu"]) * 1e3  # the run starts the runtime anyway
    log.info("preflight: %d checks passed in %.0f ms, %.0f ms of it starting the runtime (python -m tfpod.doctor "
             "runs them all; --nopreflight skips them)", len(results), (time.perf_counter() - start) * 1e3,
             runtime_ms)


__all__ = ["PREFLIGHT_MODES", "Result", "leave_together", "preflight", "run_checks"]
