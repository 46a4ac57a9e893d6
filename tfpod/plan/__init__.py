"""The planner: per-device memory and step time of a run before anything is allocated.

    python main.py --gin_file=gin/gpt_small.gin --mode=plan --plan_device=h100 \
        --plan_num_devices=64 --mesh=data:8,model:8 --model_dir=runs/plan

writes `model_dir/plan.json` and prints a summary; `--mesh=auto` plans every layout and
reports the fastest that fits, and training with `--mesh=auto` (or
`sharding.preset='auto'`) trains with it. See docs/planner.md for how to read a plan.
A bench asks for one run's prediction with `predict(configs, mesh)`.

  devices   the device table (h100, h200, a100-40g, a100-80g, tpu-v4, tpu-v5p; cpu measured)
  profile   what a task's step keeps and moves per example, in logical axes (Task.plan_profile)
  lazy      the planner's lazy build: leaf layers' output shapes; a repeated block's forward pass run once
  memory    weights, gradients, optimizer state (exact, from the layouts), activations, temporaries
  timing    the roofline model of a step
  planner   Planner: the lazily built model, planned on any mesh of devices that need not exist
  search    --mesh=auto
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from tfpod import UserError, run_folder
from tfpod.plan import devices
from tfpod.plan.planner import Choice, Planner, build_context, summary
from tfpod.plan.search import describe_best, search, top_table

log = logging.getLogger("tfpod")

PLAN_FILE = "plan.json"


def _write_json(path: str, record: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_plan(model_dir: str, fix: str = "delete it to plan again") -> dict | None:
    """model_dir/plan.json, or None.

    Raises:
      UserError: the file is damaged (not JSON, or a `trained_with` tfpod cannot read):
        one line naming it, then `fix`.
    """
    path = os.path.join(model_dir, PLAN_FILE)
    plan = run_folder.read_json(path, "a plan (with --mesh=auto, the layout the run trains with)", fix)
    if plan is None:
        return None
    trained = plan.get("trained_with") if isinstance(plan, dict) else None
    fields = {f.name for f in dataclasses.fields(Choice)}
    if not isinstance(plan, dict) or (trained is not None and (not isinstance(trained, dict) or "mesh" not in trained
                                                               or not set(trained) <= fields)):
        raise UserError(f"{path} is damaged (not a plan tfpod wrote: its trained_with needs 'mesh' and at most "
                        f"{', '.join(sorted(fields))}): it holds a plan (with --mesh=auto, the layout the run trains "
                        f"with); {fix}")
    return plan


def plan_mode(configs, model_dir: str, mesh_spec: str, device_name: str | None, num_devices: int | None,
              devices_per_host: int | None) -> dict:
    """--mode=plan: the plan of `mesh_spec` ("auto": the fastest that fits, and the top
    five) on `num_devices` x `device_name`, printed and written to model_dir/plan.json.
    Nothing is allocated and no device is created."""
    recorded = read_plan(model_dir, "delete it to plan again, or plan into another --model_dir")
    if recorded and recorded.get("trained_with"):
        raise UserError(f"--mode=plan: {os.path.join(model_dir, PLAN_FILE)} holds the layout the run in {model_dir} "
                        "trains with (--mesh=auto); plan into another --model_dir")
    if (device_name or "cpu").lower() == "cpu" and not devices_per_host:
        devices_per_host = num_devices or 8  # logical devices of this one machine
    device = devices.get(device_name or "cpu", devices_per_host)
    num_devices = num_devices or device.devices_per_host
    planner = Planner(configs, device, num_devices)
    if mesh_spec == "auto" or configs.sharding.preset == "auto":
        best, top = search(planner, mesh=None if mesh_spec == "auto" else mesh_spec)
        log.info("--mesh=auto: the %d fastest layouts:\n%s", len(top), top_table(top))
        log.info("%s", describe_best(best, top, num_devices))
        plan = dict(best or top[0], top=[{k: p[k] for k in ("choice", "step_time_s", "tokens_per_sec", "mfu", "fits",
                                                          "per_device_bytes")} for p in top])
    else:
        plan = planner.plan(Choice(mesh_spec))
    log.info("%s", summary(plan))
    os.makedirs(model_dir, exist_ok=True)
    _write_json(os.path.join(model_dir, PLAN_FILE), plan)
    log.info("plan: wrote %s", os.path.join(model_dir, PLAN_FILE))
    return plan


def predict(configs, mesh: str, device: str = "cpu", num_devices: int = 8,
            devices_per_host: int | None = None) -> dict:
    """The planner's prediction of one run on one mesh, for a bench to set beside what it
    measures (nothing is allocated; no device is created).

        configs = api.load_configs(["gin/lm_tiny.gin"], ["gpt.seq_len=4096"], model_dir)
        plan.predict(configs, "context:2,data:4")["activation_bytes"]

    Args:
      configs: the run's RunConfigs (tfpod.api.load_configs).
      mesh: the mesh spec, as --mesh takes it.
      device: a device name of tfpod.plan.devices ("cpu": this machine, measured, split
        into `num_devices` logical devices).
      num_devices: devices of the job.
      devices_per_host: devices per host (None: the device's usual; cpu: num_devices).

    Returns:
      {"activation_bytes", "temporary_bytes", "total_bytes" (per device), "step_time_s",
      "tokens_per_sec", "fits", "collectives" ({name: seconds per step}), "plan" (the whole
      plan, plan.json's fields)}.
    """
    if device.lower() == "cpu" and not devices_per_host:
        devices_per_host = num_devices
    p = Planner(configs, devices.get(device, devices_per_host), num_devices).plan(Choice(mesh))
    b = p["per_device_bytes"]
    return {"activation_bytes": b["activations"], "temporary_bytes": b["temporary"], "total_bytes": b["total"],
            "step_time_s": p["step_time_s"], "tokens_per_sec": p["tokens_per_sec"], "fits": p["fits"],
            "collectives": dict(p["breakdown"]["time"]["collectives"]), "plan": p}


def predict_checkpoint_bytes(configs) -> tuple[int, int]:
    """(bytes of one checkpoint, parameters) of a run, from the planner's lazy build (nothing
    is allocated; memory.checkpoint_bytes)."""
    import math

    from tfpod import partitioning
    from tfpod.plan import lazy, memory
    from tfpod.precision import precision_policy

    task, model_config = configs.task, configs.model
    with precision_policy(configs.train.precision), build_context(configs), lazy.recorded_build():
        _, specs = partitioning.lazy_model(lambda: task.build(model_config), task.input_signature(model_config))
    parameters = sum(math.prod(s.shape) for s in specs)
    return memory.checkpoint_bytes(specs, configs.optimizer, adapters_only=configs.lora is not None), parameters


def running_device(info) -> devices.DeviceSpec:
    """The spec of the devices this job runs on (cpu: measured; accelerators by name)."""
    if info.device_type == "CPU":
        return devices.cpu(info.num_local_devices)
    import tensorflow as tf

    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices(info.device_type)[0])
    name = details.get("device_name", "").upper()
    for marker, key in (("H200", "h200"), ("H100", "h100"), ("A100-SXM4-80GB", "a100-80g"), ("A100 80GB", "a100-80g"),
                        ("A100", "a100-40g"), ("V5P", "tpu-v5p"), ("V4", "tpu-v4")):
        if marker in name:
            return devices.get(key, info.num_local_devices)
    raise UserError(f"--mesh=auto: no spec for device {details.get('device_name', info.device_type)!r} in the "
                    f"planner's table ({', '.join(devices.names())}): pass --mesh by hand")


def choose_for_run(configs, mesh_spec: str, info, model_dir: str) -> str:
    """--mesh=auto (or sharding.preset='auto') when training: the layout the planner picks
    for this job's devices, applied to `configs` in place; the mesh spec is returned.

    The choice is kept in model_dir/plan.json (`trained_with`), so a resumed run
    trains on with the same layout whatever the machine measures the next time.
    """
    recorded = read_plan(model_dir, "restore it from a backup, or delete it and --mesh=auto plans again (the "
                                    "checkpoints restore onto whatever layout it picks)") if model_dir else None
    planner = Planner(configs, running_device(info), info.num_global_devices)
    if recorded and recorded.get("trained_with"):
        choice = Choice(**recorded["trained_with"])
        log.info("--mesh=auto: %s, the layout this run chose at its start (%s)", choice.describe(),
                 os.path.join(model_dir, PLAN_FILE))
        plan = None
    else:
        best, top = search(planner, mesh=None if mesh_spec == "auto" else mesh_spec)
        log.info("--mesh=auto: the %d fastest layouts on this job's %d devices:\n%s", len(top),
                 info.num_global_devices, top_table(top))
        log.info("%s", describe_best(best, top, info.num_global_devices))
        if best is None:
            raise UserError(describe_best(best, top, info.num_global_devices))
        plan = best
        choice = Choice(best["mesh"], best["preset"], best["sequence_parallel"],
                        best["remat"] if configs.task.recomputes else None, best["microbatches"],
                        best["breakdown"]["tables"]["placement"] if configs.task.sparse_tables else None)
    configs.model, configs.train, configs.sharding = planner.configs_for(choice)
    if plan is not None and model_dir and info.client_id == 0:
        os.makedirs(model_dir, exist_ok=True)
        _write_json(os.path.join(model_dir, PLAN_FILE), dict(plan, trained_with=dict(
            mesh=choice.mesh, preset=choice.preset, sequence_parallel=choice.sequence_parallel, remat=choice.remat,
            microbatches=choice.microbatches, tables=choice.tables)))
    return choice.mesh


__all__ = ["Choice", "Planner", "choose_for_run", "devices", "plan_mode", "predict", "predict_checkpoint_bytes",
           "read_plan", "running_device", "search", "summary"]
