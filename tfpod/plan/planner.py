"""A run's plan: per-device memory, whether it fits, and the predicted step time.

`Planner` builds the model once with lazily initialized variables (nothing allocated:
a GPT-3 175B builds on a laptop, in seconds, as `lazy` runs a repeated block's forward
pass once), then `plan(choice)` lays it out on a mesh of devices that need not exist
(DTensor meshes of device names only) with the same rules the trainer uses, and adds up:

  weights, gradients, optimizer   exact, from the layouts (they equal layouts.txt)
  activations, temporary          the task's Profile laid out by the same rules (memory.py)
  step time                       the roofline model (timing.py)

A `Choice` is what varies between plans of one experiment: the mesh spec, the preset,
sequence parallelism, recomputation and microbatches (tfpod.plan.search enumerates
them for --mesh=auto).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Mapping

from tfpod import UserError, attention
from tfpod.plan import lazy, memory, timing
from tfpod.partitioning.report import human_bytes
from tfpod.plan.devices import DeviceSpec

log = logging.getLogger("tfpod")

MEMORY_MARGIN = 0.10  # a plan fits when its total leaves this fraction of the device's memory free
BUILD_BLOCK_SIZE = 2**30  # blockwise attention's block in the planner's build (the variables do not depend on it)


def build_context(configs):
    """The context the planner traces a run's model in (it compiles no step: tfpod.attention.using):
    the run's attention with one block pair per attention, enough for shapes, where the run's
    block size would unroll (length / block)^2 / 2 of them (minutes of graph building at
    131,072 tokens)."""
    return attention.using(dataclasses.replace(configs.attention or attention.DEFAULT, block_size=BUILD_BLOCK_SIZE))


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a plan varies: the mesh spec and the switches that change memory and time.

    None keeps the experiment's own setting.
    """

    mesh: str
    preset: str | None = None
    sequence_parallel: bool | None = None
    remat: bool | None = None
    microbatches: int | None = None
    tables: str | None = None  # embedding tables: "rows" or "whole" (sharding.tables)

    def describe(self) -> str:
        parts = [self.mesh, f"preset={self.preset}"]
        if self.tables == "whole":
            parts.append("tables=whole")
        if self.sequence_parallel:
            parts.append("sequence_parallel")
        if self.remat:
            parts.append("remat")
        if self.microbatches and self.microbatches > 1:
            parts.append(f"microbatches={self.microbatches}")
        return " ".join(parts)


class Planner:
    """Plans of one experiment (its RunConfigs) on `num_devices` devices of one kind.

    Args:
      configs: api.RunConfigs of the experiment.
      device: the device spec (tfpod.plan.devices.get).
      num_devices: devices of the whole job.
    """

    def __init__(self, configs, device: DeviceSpec, num_devices: int):
        from tfpod import partitioning
        from tfpod.precision import precision_policy

        if num_devices < 1:
            raise UserError(f"--plan_num_devices={num_devices} must be at least 1")
        self.c, self.device, self.num_devices = configs, device, num_devices
        self.devices_per_host = min(device.devices_per_host, num_devices)
        if num_devices % self.devices_per_host:
            raise UserError(f"--plan_num_devices={num_devices} is not a whole number of hosts of "
                            f"{self.devices_per_host} devices (--plan_devices_per_host)")
        self.num_hosts = num_devices // self.devices_per_host
        task, model_config = configs.task, configs.model
        log.info("plan: building %s with lazily initialized variables (nothing is allocated) ...", task.name)
        with precision_policy(configs.train.precision), build_context(configs), lazy.recorded_build() as outputs:
            self.model, self.specs = partitioning.lazy_model(lambda: task.build(model_config),
                                                             task.input_signature(model_config))
        with attention.using(configs.attention):  # the step the profile describes attends with the run's
            self.profile = task.plan_profile(model_config, outputs)
        if self.profile is None:
            raise UserError(f"model {task.name!r} has no plan profile (Task.plan_profile): the planner cannot "
                            "predict its activations")
        from tfpod import compat, embedding
        from tfpod.partitioning.build import var_name

        # embedding tables (tfpod.embedding): gradients as rows, updated by rows (memory.state_bytes)
        self.sparse = frozenset(var_name(compat.inner_variable(layer.embeddings))
                                for layer in embedding.find_layers(self.model))
        self.parameters = sum(math.prod(s.shape) for s in self.specs if s.trainable)
        self.frozen = sum(math.prod(s.shape) for s in self.specs if not s.trainable)  # (LoRA's base, BN's statistics)
        tokens = task.tokens_per_example(model_config)
        self.tokens_per_example = tokens or 1
        self.flops_per_example = task.step_flops_per_token(model_config, self.specs) * (tokens or 1)
        self.full_flops_per_example = task.flops_per_token(model_config) * (tokens or 1)  # (LoRA's: more)

    def _meshes(self, spec: str):
        from tfpod import mesh as meshlib
        from tfpod.partitioning import stages

        axes = meshlib.parse_mesh_spec(spec, self.num_devices)
        num_stages, rest = stages.split_stage_axis(axes)
        if num_stages > 1 and not rest:
            raise UserError(f"--mesh={spec!r}: a stage needs other axes too, e.g. 'stage:2,data:-1'")
        device_type = "CPU" if self.device.name == "cpu" else ("TPU" if self.device.name.startswith("tpu") else "GPU")
        meshes = stages.stage_meshes(rest, num_stages, device_type, self.num_hosts, 0, self.devices_per_host)
        return axes, num_stages, rest, meshes

    def _check_context(self, table, mesh) -> int:
        """The size of the mesh axis the activations' `length` is split over (1: none).

        Raises:
          UserError: the task's attention cannot be split so (Profile.context_length 0), or
            the axis does not split the sequence into two equal chunks per device (the
            load-balanced causal split's 2 x context chunks).
        """
        axis = table.get("length")
        n = mesh.dim_size(axis) if axis in mesh.dim_names else 1
        if n <= 1:
            return 1
        length = self.profile.context_length
        if not length:
            raise UserError(f"mesh axis {axis!r} (size {n}) splits the sequence (context parallelism), which model "
                            f"{self.c.task.name!r} does not support: its attention cannot gather keys and values over "
                            f"it; leave {axis!r} out of --mesh")
        if length % (2 * n):
            raise UserError(f"mesh axis {axis!r} of size {n} does not split the sequence of {length} tokens into "
                            f"{2 * n} equal chunks (context parallelism's causal balance): use a size whose double "
                            f"divides {length}")
        return n

    def configs_for(self, choice: Choice):
        """(model, train, sharding) configs with the choice applied (each validated as gin would)."""
        c = self.c
        model = c.model
        if choice.remat is not None and self.c.task.recomputes and model.remat != choice.remat:
            model = dataclasses.replace(model, remat=choice.remat)
        train = c.train if choice.microbatches is None else dataclasses.replace(c.train, microbatches=choice.microbatches)
        sharding = c.sharding
        if choice.preset is not None or choice.sequence_parallel is not None:
            sharding = dataclasses.replace(
                sharding, preset=choice.preset if choice.preset is not None else sharding.preset,
                sequence_parallel=(choice.sequence_parallel if choice.sequence_parallel is not None
                                   else sharding.sequence_parallel))
        if choice.tables is not None:
            sharding = dataclasses.replace(sharding, tables=choice.tables)
        return model, train, sharding

    def _heaviest_position(self, layouts: dict, mesh) -> tuple[list, dict]:
        """(specs, layouts) of one device of the most loaded position with tables placed whole
        (tfpod.embedding.whole): the other weights, and there the tables at that position, each
        laid out whole (their rows not split).

        Raises:
          UserError: no table's rows map to a mesh axis (as training refuses).
        """
        from tensorflow.experimental import dtensor

        from tfpod.embedding import whole

        split = whole.row_axes(self.sparse, layouts)
        kept = set()
        for axis in set(split.values()):
            kept.update(whole.heaviest({s.name: math.prod(s.shape) * s.dtype.size for s in self.specs
                                        if split.get(s.name) == axis}, mesh.dim_size(axis)))
        layouts = {**layouts, **{n: dtensor.Layout([dtensor.UNSHARDED] + list(layouts[n].sharding_specs[1:]), mesh)
                                 for n in kept}}
        return [s for s in self.specs if s.name not in split or s.name in kept], layouts

    def plan(self, choice: Choice) -> dict:
        """The plan of one choice (plan.json's fields).

        Raises:
          UserError: the choice cannot run (the same checks training makes: a mesh axis
            no rule uses, a dimension a mesh axis does not divide, a batch the data axis
            does not divide, microbatches that do not divide the batch shards).
        """
        from tfpod import compat, pipeline
        from tfpod.partitioning import Placement, check_microbatches, resolve
        from tfpod.partitioning.build import var_name

        c, task, device = self.c, self.c.task, self.device
        model_config, train, sharding = self.configs_for(choice)
        axes, num_stages, rest, meshes = self._meshes(choice.mesh)
        placement = Placement.from_config(sharding, task.default_preset, meshes)
        placement.preset.check_run(task, placement)  # what training would refuse (e.g. 2d inside stages)
        mesh, table = placement.mesh, placement.table
        preset = placement.preset.name
        if self.sparse and (placement.update_axis or num_stages > 1):  # (tfpod.embedding.executor.check_supported)
            raise UserError(f"preset {preset!r}: embedding tables train without a sharded update or pipeline stages")
        layouts = resolve(self.specs, task.axis_rules, table, mesh)
        stage_of = {}
        if num_stages > 1:
            owner = pipeline.variable_stages(pipeline.staged_model(task, self.model), num_stages)
            stage_of = {var_name(compat.inner_variable(v)): owner.get(id(compat.inner_variable(v)), 0)
                        for v in self.model.variables}
        batch_axis = placement.batch_axis(tuple(next(iter(task.batch_axes().values()))))
        context = self._check_context(table, mesh)
        shards = mesh.dim_size(batch_axis) if batch_axis else 1
        global_batch = train.global_batch_size
        if global_batch % shards:
            raise UserError(f"train.global_batch_size={global_batch} does not divide over mesh axis {batch_axis!r} "
                            f"of size {shards}: use a multiple of {shards}")
        if train.microbatches > 1:
            check_microbatches(global_batch, shards, train.microbatches)
        # the weights' gradients are summed over every axis that splits the tokens: the batch's, and the sequence's
        token_axes = [a for a in (batch_axis, table.get("length") if context > 1 else None) if a]
        specs = self.specs
        if placement.tables == "whole" and self.sparse:
            specs, layouts = self._heaviest_position(layouts, mesh)
        state = memory.state_bytes(specs, layouts, stage_of, num_stages, c.optimizer, placement.update_axis,
                                   placement.gather_axis, token_axes, self.sparse)
        remat = bool(model_config.remat) if task.recomputes else False
        acts = memory.activation_bytes(self.profile, global_batch, table, mesh, train.precision, remat, num_stages,
                                       train.microbatches, sharding.pipeline_schedule, state.gradients, state.gathered)
        per_device = {"weights": state.weights, "gradients": state.gradients, "optimizer": state.optimizer,
                      "activations": int(acts.activations), "temporary": int(acts.temporary)}
        per_device["total"] = sum(per_device.values())
        sizes = {mesh.dim_names[i]: mesh.dim_size(mesh.dim_names[i]) for i in range(len(mesh.dim_names))}
        bandwidths = timing.axis_bandwidths(rest, device, num_stages)
        flops_per_step = self.flops_per_example * global_batch
        t = timing.step_time(device=device, precision=train.precision, flops_per_step=flops_per_step,
                             num_devices=self.num_devices, profile=self.profile, remat=remat, table=table, mesh=mesh,
                             mesh_sizes=sizes, bandwidths=bandwidths, global_batch=global_batch, state=state,
                             activation_bytes=acts.activations, num_trainable=sum(s.trainable for s in self.specs),
                             num_stages=num_stages, microbatches=train.microbatches,
                             full_flops_per_step=self.full_flops_per_example * global_batch)
        step = t["step_time_s"]
        tokens = global_batch * self.tokens_per_example
        fits = per_device["total"] <= device.memory_bytes * (1 - MEMORY_MARGIN)
        return {
            "model": task.name, "mesh": ",".join(f"{n}:{s}" for n, s in axes), "preset": preset, "context": context,
            "sequence_parallel": bool(sharding.sequence_parallel), "remat": remat,
            "microbatches": train.microbatches, "stages": num_stages,
            "pipeline_schedule": sharding.pipeline_schedule if num_stages > 1 else None,
            "precision": train.precision, "global_batch": global_batch, "tokens_per_step": tokens,
            "device": device.name, "num_devices": self.num_devices, "devices_per_host": self.devices_per_host,
            "num_hosts": self.num_hosts, "parameters": self.parameters, "frozen_parameters": self.frozen,
            "per_device_bytes": per_device, "device_memory": int(device.memory_bytes),
            "memory_margin": MEMORY_MARGIN, "fits": bool(fits),
            "step_time_s": step, "tokens_per_sec": tokens / step, "examples_per_sec": global_batch / step,
            "mfu": flops_per_step / step / (self.num_devices * device.flops(train.precision)),
            "breakdown": {"memory": {k: (int(v) if isinstance(v, float) else v) for k, v in acts.breakdown.items()},
                          "time": t, "gradient_sync": [{"axis": a, "bytes": b, "kind": k}
                                                       for a, b, k in state.gradient_sync],
                          "bandwidths": bandwidths, "device_spec": device.to_json(),
                          "tables": {"count": len(self.sparse), "weights": state.sparse,
                                     "slots": state.sparse_slots, "placement": placement.tables},
                          "model_flops_per_step": flops_per_step},
        }


def summary(plan: Mapping, top: list | None = None) -> str:
    """The readable plan: what it is, where the bytes go, and the time."""
    b = plan["per_device_bytes"]
    t = plan["breakdown"]["time"]
    switches = [s for s, on in (("sequence parallel", plan["sequence_parallel"]), ("remat", plan["remat"])) if on]
    if plan["stages"] > 1 or plan["microbatches"] > 1:
        switches.append(f"{plan['microbatches']} microbatches" + (f", {plan['stages']} stages "
                                                                  f"({plan['pipeline_schedule']})"
                                                                  if plan["stages"] > 1 else ""))
    lines = [
        f"plan: {plan['model']} ({plan['parameters']:,} parameters"
        + (f" trained, {plan['frozen_parameters']:,} not" if plan.get("frozen_parameters") else "")
        + f") on {plan['num_devices']} x {plan['device']} "
        f"({plan['num_hosts']} host(s) of {plan['devices_per_host']}); mesh {plan['mesh']}, preset {plan['preset']}"
        + (f", {', '.join(switches)}" if switches else "") + f"; {plan['precision']}; global batch "
        f"{plan['global_batch']}",
        "memory per device: " + ", ".join(f"{k} {human_bytes(b[k])}" for k in
                                          ("weights", "gradients", "optimizer", "activations", "temporary")),
        f"  total {human_bytes(b['total'])} of {human_bytes(plan['device_memory'])}: "
        + ("fits" if plan["fits"] else f"DOES NOT FIT (with a {plan['memory_margin']:.0%} margin)"),
        f"step time {plan['step_time_s']:.4g} s: compute {t['compute_s']:.3g} s (matmuls {t['matmul_s']:.3g} s, "
        f"memory-bound {t['activation_passes_s']:.3g} s), optimizer {t['optimizer_s']:.3g} s, collectives "
        f"{t['collectives_s']:.3g} s, bubble {t['bubble_s']:.3g} s, op overhead {t['op_overhead_s']:.3g} s",
    ]
    for name, seconds in sorted(t["collectives"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name}: {seconds:.3g} s")
    lines.append(f"predicted {plan['tokens_per_sec']:,.0f} tokens/s ({plan['examples_per_sec']:,.1f} examples/s), "
                 f"MFU {plan['mfu']:.1%}")
    return "\n".join(lines)
