"""--mesh=auto: enumerate the ways to lay a run out, keep those that fit, pick the fastest.

The candidates are every mesh of the job's devices over the axes the task's presets
use (`data`, `model`; `expert` for a mixture of experts; `stage` for a task that
pipelines), times the presets, sequence parallelism (with a `model` axis),
recomputation (for a model that has it) and, with stages, microbatches; without stages, a
layout that does not fit is tried again with gradient accumulation (2, 4, 8, ...
microbatches, every task) until one fits or the batch shards refuse. A candidate
training would refuse (a mesh axis no rule uses, a dimension an axis does not divide)
is dropped. Of those whose plan fits the device memory with the margin, the fastest
predicted step wins; ties go to the simpler layout (fewer switches, then the earlier
preset).

Context parallelism (a `context` axis splitting the sequence, for a task whose profile
allows it: `Profile.context_length`) is tried only when no layout without it fits: then
the meshes `data`, `context`, `model` (`expert`) with every `context` size above 1 that
divides the devices and leaves each device a whole number of attention blocks
(`context_sizes`), without sequence parallelism (both would split the residual stream's
sequence, a dimension DTensor splits over one mesh axis) and without stages, join the
candidates, and the fastest that fits wins.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Iterator

from tfpod import UserError
from tfpod.partitioning import CONTEXT_AXIS, PRESETS
from tfpod.plan.planner import Choice, Planner

log = logging.getLogger("tfpod")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(num_devices: int, names: tuple) -> Iterator[str]:
    """Every spec over `names` (in this order) whose sizes multiply to num_devices;
    axes of size 1 are left out (but `data` always appears)."""
    def split(n, k):
        if k == 1:
            yield (n,)
            return
        for d in _divisors(n):
            for rest in split(n // d, k - 1):
                yield (d,) + rest

    seen = set()
    for sizes in split(num_devices, len(names)):
        axes = [(a, s) for a, s in zip(names, sizes) if s > 1 or a == "data"]
        spec = ",".join(f"{a}:{s}" for a, s in axes)
        if spec not in seen:
            seen.add(spec)
            yield spec


def context_sizes(planner: Planner) -> list[int]:
    """The `context` axis sizes --mesh=auto tries: above 1, dividing the devices, and leaving
    each device a whole number of the attention's blocks (none for a task whose attention
    cannot be split over `context`)."""
    length, block = planner.profile.context_length, max(1, planner.profile.context_block)
    return [c for c in _divisors(planner.num_devices)
            if c > 1 and length and length % c == 0 and (length // c) % block == 0 and length % (2 * c) == 0]


def _context_meshes(planner: Planner, names: list) -> Iterator[str]:
    """Meshes over `names` with a `context` axis of each of `context_sizes` (placed before `model`)."""
    rest = [n for n in names if n != "stage"]
    for size in context_sizes(planner):
        for spec in _meshes(planner.num_devices // size, tuple(rest)):
            axes = spec.split(",")
            axes.insert(1, f"{CONTEXT_AXIS}:{size}")  # data (always first), context, model, expert
            yield ",".join(axes)


def candidates(planner: Planner, mesh: str | None = None, context: bool = False) -> Iterator[Choice]:
    """Every choice to plan for this experiment on the planner's devices (on `mesh`
    only when given: sharding.preset='auto' with a mesh chooses the rest); with `context`,
    the meshes with a `context` axis instead (`_context_meshes`)."""
    task = planner.c.task
    logical = {a for rule in task.axis_rules for a in rule.axes if a}
    names = ["data"]
    if logical & {"heads", "mlp", "vocab"}:
        names.append("model")
    if "expert" in logical:
        names.append("expert")
    if task.pipelines:
        names.insert(0, "stage")
    has_remat = task.recomputes
    placements = ("rows", "whole") if task.sparse_tables else (None,)  # embedding tables' (sharding.tables)
    if mesh:
        specs = [mesh]
    else:
        specs = _context_meshes(planner, names) if context else _meshes(planner.num_devices, tuple(names))
    for spec in specs:
        sizes = dict(p.split(":") for p in spec.replace(" ", "").split(","))
        stages = int(sizes.get("stage", 1))
        for preset in PRESETS.values():  # in registration order
            if not preset.tried_on(sizes):
                continue
            splits_model = "model" in sizes and "model" in preset.table.values()
            for sp in ((False, True) if splits_model and CONTEXT_AXIS not in sizes else (False,)):
                for remat, tables in itertools.product((False, True) if has_remat else (None,), placements):
                    if stages > 1:
                        for m in (stages, 2 * stages, 4 * stages):  # plan() drops those the batch refuses
                            yield Choice(spec, preset.name, sp, remat, m, tables)
                    else:
                        yield Choice(spec, preset.name, sp, remat, None, tables)


def _plans(planner: Planner, choice: Choice) -> list[tuple[Choice, dict]]:
    """(choice, its plan) for `choice` (none when training would refuse it); without stages,
    when it does not fit, also the first of 2, 4, 8, ... microbatches (gradient accumulation)
    that does."""
    try:
        plans = [(choice, planner.plan(choice))]
    except UserError:
        return []
    if plans[0][1]["fits"] or plans[0][1]["stages"] > 1 or choice.microbatches is not None:
        return plans
    m = 2
    while True:
        accumulated = dataclasses.replace(choice, microbatches=m)
        try:
            plan = planner.plan(accumulated)
        except UserError:  # the batch shards do not split into m
            return plans
        if plan["fits"]:
            return plans + [(accumulated, plan)]
        m *= 2


def search(planner: Planner, top: int = 5, mesh: str | None = None) -> tuple[dict | None, list[dict]]:
    """(the fastest plan that fits or None, the `top` plans by predicted step time:
    fitting plans first); on `mesh` only when given."""
    plans = []

    def plan_all(choices: list, what: str) -> None:
        log.info("--mesh=auto: planning %d layouts of %s on %d devices%s ...", len(choices), planner.c.task.name,
                 planner.num_devices, what)
        for choice in choices:
            for made, plan in _plans(planner, choice):
                plan["choice"] = made.describe()
                plan["_rank"] = (not plan["fits"], plan["step_time_s"],
                                 bool(plan["sequence_parallel"]) + bool(plan["remat"]), len(plans))
                plans.append(plan)

    plan_all(list(candidates(planner, mesh)), "")
    if not mesh and not any(p["fits"] for p in plans) and context_sizes(planner):
        plan_all(list(candidates(planner, context=True)),
                 f" with a {CONTEXT_AXIS!r} axis (none without one fits)")
    if not plans:
        where = f"mesh {mesh}" if mesh else f"{planner.num_devices} devices"
        raise UserError(f"--mesh=auto / sharding.preset='auto': no layout of model {planner.c.task.name!r} can run on "
                        f"{where} (every choice was refused by the sharding rules): pick --mesh and "
                        "sharding.preset by hand to see why")
    plans.sort(key=lambda p: p["_rank"])
    for p in plans:
        del p["_rank"]
    best = plans[0] if plans[0]["fits"] else None
    return best, plans[:top]


def top_table(plans: list[dict]) -> str:
    """The top plans, one line each: step time, tokens/s, memory per device, fit."""
    lines = ["  rank  step time  tokens/s      MFU    memory/device  fits  layout"]
    for i, p in enumerate(plans, 1):
        lines.append(f"  {i:>4}  {p['step_time_s']:>8.4g}s  {p['tokens_per_sec']:>10,.0f}  {p['mfu']:>6.1%}  "
                     f"{p['per_device_bytes']['total'] / 2**30:>10.2f} GiB  {'yes' if p['fits'] else 'no ':>4}  "
                     f"{p['choice']}")
    return "\n".join(lines)


def describe_best(best: dict | None, plans: list[dict], num_devices: int) -> str:
    """The one line --mesh=auto logs about its choice."""
    if best is None:
        smallest = min(plans, key=lambda p: p["per_device_bytes"]["total"])
        return (f"--mesh=auto: no layout fits {num_devices} x {smallest['device']}: the smallest needs "
                f"{smallest['per_device_bytes']['total'] / 2**30:.2f} GiB per device of "
                f"{smallest['device_memory'] / 2**30:.2f} GiB ({smallest['choice']}); use more devices, a smaller "
                f"batch, or train.precision='mixed_bfloat16'")
    return (f"--mesh=auto chose {best['choice']}: predicted {best['step_time_s']:.4g} s/step, "
            f"{best['tokens_per_sec']:,.0f} tokens/s, {best['per_device_bytes']['total'] / 2**30:.2f} GiB per device")
