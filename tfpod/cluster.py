"""Which host am I, and where are the others: a multi-host job's layout from its cluster manager.

DTensor's multi-client runtime reads DTENSOR_CLIENT_ID, DTENSOR_NUM_CLIENTS,
DTENSOR_JOB_NAME and DTENSOR_JOBS (every host's address, in host order). tfpod.launch
and the --num_hosts/--host_id/--host_addresses flags set them; under a cluster manager
they are derived here when none is set:

  SLURM       SLURM_PROCID (host id), SLURM_NTASKS (hosts), SLURM_STEP_NODELIST or
              SLURM_JOB_NODELIST in SLURM's compressed form (`node[01-04,07],gpu5`),
              SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (`2(x3),1`): tasks fill
              the nodes in order (SLURM's block distribution), and each task on a node
              gets its own port, TFPOD_PORT (default 8476) + its index on the node. A
              task's GPUs: with several tasks on a node and no CUDA_VISIBLE_DEVICES, the
              node's GPUs split evenly by SLURM_LOCALID (TFPOD_GPUS_PER_TASK, default 1).
  Kubernetes  JOB_COMPLETION_INDEX (an Indexed Job's or a JobSet's pod index) is the
              host id; TFPOD_NUM_HOSTS the host count; every pod's address is
              `<TFPOD_HOST_PREFIX><index>.<TFPOD_SERVICE>` (the pods' hostnames under the
              headless Service: deploy/kubernetes/) and TFPOD_PORT.

`from_environment` returns the layout (or None outside any cluster); `apply` writes it
into the DTENSOR_* variables and says so on the console.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Mapping

from tfpod import UserError

log = logging.getLogger("tfpod")

DEFAULT_PORT = 8476


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """A multi-host job as DTensor needs it, and where it came from."""

    host_id: int
    num_hosts: int
    addresses: tuple  # "host:port" of every host, in host order
    source: str  # "slurm" or "kubernetes"
    local_index: int = 0  # this task's index on its node (SLURM)
    visible_gpus: str | None = None  # CUDA_VISIBLE_DEVICES to set, if any


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list: `node[01-04,07],gpu5` -> node01 .. node04, node07, gpu5.

    Zero padding is kept (`[08-10]` -> 08, 09, 10); several bracketed ranges in one name
    multiply (`r[1-2]n[1-2]`).
    """
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            part = text[start:i].strip()
            if part:
                names.extend(_expand_one(part, text))
            start = i + 1
    if depth:
        raise UserError(f"SLURM node list {text!r}: unbalanced brackets")
    return names


def _expand_one(part: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", part)
    if not m:
        return [part]
    head, tail = part[:m.start()], part[m.end():]
    out = []
    for item in m.group(1).split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise UserError(f"SLURM node list {whole!r}: {item!r} is not a number or a range")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}", whole))
    return out


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks per node: `2(x3),1` -> [2, 2, 2, 1]."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise UserError(f"SLURM tasks per node {text!r}: {item!r} is not N or N(xK)")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def _port(env: Mapping[str, str]) -> int:
    text = env.get("TFPOD_PORT", str(DEFAULT_PORT))
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UserError(f"TFPOD_PORT={text!r} is not a port: give the first port of the job's tasks, e.g. 8476")
    return int(text)


def from_slurm(env: Mapping[str, str]) -> HostLayout:
    """The layout of a SLURM job step from its environment (see the module docstring)."""
    try:
        host_id, num_hosts = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    except (KeyError, ValueError):
        raise UserError("SLURM: SLURM_PROCID and SLURM_NTASKS must be set (run the job's tasks with srun)") from None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise UserError("SLURM: neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set (run the tasks with srun)")
    nodes = expand_nodelist(nodelist)
    per_node_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    per_node = expand_tasks_per_node(per_node_text) if per_node_text else [num_hosts // len(nodes)] * len(nodes)
    if len(per_node) != len(nodes) or sum(per_node) != num_hosts:
        raise UserError(f"SLURM: {len(nodes)} node(s) ({nodelist}) with tasks per node {per_node_text!r} do not make "
                        f"SLURM_NTASKS={num_hosts} tasks: use srun's default block distribution")
    base = _port(env)
    addresses = [f"{node}:{base + i}" for node, count in zip(nodes, per_node) for i in range(count)]
    if not 0 <= host_id < num_hosts:
        raise UserError(f"SLURM: SLURM_PROCID={host_id} is not in [0, SLURM_NTASKS={num_hosts})")
    local = int(env.get("SLURM_LOCALID", "0"))
    gpus = None
    node_of = [n for n, count in zip(nodes, per_node) for _ in range(count)]
    if "CUDA_VISIBLE_DEVICES" not in env and node_of.count(node_of[host_id]) > 1:
        k = env.get("TFPOD_GPUS_PER_TASK", "1")
        if not k.isdigit() or int(k) < 1:
            raise UserError(f"TFPOD_GPUS_PER_TASK={k!r} must be a positive integer: the GPUs each task on a node takes")
        gpus = ",".join(str(local * int(k) + i) for i in range(int(k)))
    return HostLayout(host_id, num_hosts, tuple(addresses), "slurm", local, gpus)


def from_kubernetes(env: Mapping[str, str]) -> HostLayout:
    """The layout of an Indexed Job or JobSet pod from its environment (see the module docstring)."""
    missing = [k for k in ("TFPOD_NUM_HOSTS", "TFPOD_SERVICE", "TFPOD_HOST_PREFIX") if not env.get(k)]
    if missing:
        raise UserError(f"Kubernetes: JOB_COMPLETION_INDEX is set but {', '.join(missing)} is not: set them in the pod "
                        "spec (deploy/kubernetes/ does)")
    try:
        host_id, num_hosts = int(env["JOB_COMPLETION_INDEX"]), int(env["TFPOD_NUM_HOSTS"])
    except ValueError:
        raise UserError("Kubernetes: JOB_COMPLETION_INDEX and TFPOD_NUM_HOSTS must be integers") from None
    if not 0 <= host_id < num_hosts:
        raise UserError(f"Kubernetes: JOB_COMPLETION_INDEX={host_id} is not in [0, TFPOD_NUM_HOSTS={num_hosts}): make "
                        "the Job's completions and parallelism equal TFPOD_NUM_HOSTS")
    port, prefix, service = _port(env), env["TFPOD_HOST_PREFIX"], env["TFPOD_SERVICE"]
    return HostLayout(host_id, num_hosts, tuple(f"{prefix}{i}.{service}:{port}" for i in range(num_hosts)),
                      "kubernetes")


def from_environment(env: Mapping[str, str] | None = None) -> HostLayout | None:
    """The cluster manager's layout of this job, or None (no cluster, or DTENSOR_* already set)."""
    env = os.environ if env is None else env
    if any(k.startswith("DTENSOR_") for k in env):
        return None
    if "JOB_COMPLETION_INDEX" in env:
        return from_kubernetes(env)
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return from_slurm(env)
    return None


def apply(layout: HostLayout) -> None:
    """Sets DTensor's multi-client variables (and a task's GPUs) from `layout`, and logs them."""
    os.environ.update({"DTENSOR_CLIENT_ID": str(layout.host_id), "DTENSOR_NUM_CLIENTS": str(layout.num_hosts),
                       "DTENSOR_JOB_NAME": os.environ.get("DTENSOR_JOB_NAME", "worker"),
                       "DTENSOR_JOBS": ",".join(layout.addresses)})
    if layout.visible_gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = layout.visible_gpus
    shown = ", ".join(layout.addresses[:4]) + (f", ... ({layout.num_hosts} in all)" if layout.num_hosts > 4 else "")
    log.info("%s: host %d of %d; hosts %s%s", layout.source, layout.host_id, layout.num_hosts, shown,
             f"; GPUs {layout.visible_gpus}" if layout.visible_gpus is not None else "")
