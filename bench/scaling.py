"""Scaling: the same global batch on 1, 2, 4 and 8 logical devices, and on 1 vs 2 hosts.

    python bench/scaling.py [--model=gpt_small] [--num_layers=4] [--global_batch=8]
        [--seq_len=512] [--devices=1,2,4,8] [--hosts=2] [--preset=data] [--warmup=2]
        [--steps=4] [--steps_per_loop=2]

Every point trains the same model from the same seed on the same synthetic global
batches with tfpod's Trainer (bench/train_throughput.py's `tfpod` run), each in its own
fresh process, one after the other:

  devices   one host whose CPU is split into N logical devices, mesh `data:N`, or
            `data:N/K,model:K` with --model_parallel=K once N >= K (the `--preset`
            decides how weights are laid out: `data` replicates them, `weight_update`
            shards the optimizer update over `data`, `tensor` splits them over `model`)
  hosts     --hosts local processes (tfpod.launch: real DTensor clients on loopback),
            each with max(--devices) / hosts logical devices, on the same global mesh
            as the largest one-host point

`relative` is a point's tokens/s over the 1-device point's; `hosts_vs_one_host` is the
multi-host rate over the one-host rate on the same number of devices. All logical
devices share this machine's cores, so the ideal is 1.0 (the same work, split), and
what falls short of it is what the sharded program costs: per-device op dispatch,
gradient all-reduces between devices and, across hosts, the collectives over loopback.

The default model is gpt_small's shape with 4 layers and length 512, so that `data:8`
(8 replicas of the weights and optimizer state in one machine's memory) fits in 23 GiB.

The last line is one JSON object: {"model", ..., "points": [{"devices", "hosts",
"mesh", "tokens_per_sec", "relative", ...}], "relative_8": the 8-device point's
relative rate, "hosts_vs_one_host"}. A failed point has "error"; the script then exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THROUGHPUT = os.path.join(ROOT, "bench", "train_throughput.py")


def mesh_spec(devices: int, model_parallel: int) -> str:
    """data:N, or data:N/K,model:K once N >= K (K = --model_parallel)."""
    k = model_parallel if devices >= model_parallel else 1
    return f"data:{devices // k}" + (f",model:{k}" if k > 1 else "")


def point(args, devices: int, hosts: int = 1) -> dict:
    """tokens/s of one configuration, from train_throughput.py's tfpod worker."""
    per_host = devices // hosts
    mesh = mesh_spec(devices, args.model_parallel)
    worker = [sys.executable, THROUGHPUT, "--worker=tfpod", f"--model={args.model}", f"--mesh={mesh}",
              f"--cpu_devices={per_host}", f"--preset={args.preset}", f"--rules={args.rules}", f"--global_batch={args.global_batch}",
              f"--seq_len={args.seq_len}", f"--warmup={args.warmup}", f"--steps={args.steps}",
              f"--steps_per_loop={args.steps_per_loop}"] + ([f"--num_layers={args.num_layers}"] if args.num_layers else [])
    cmd = worker if hosts == 1 else [sys.executable, "-m", "tfpod.launch", f"--num_hosts={hosts}",
                                     f"--devices_per_host={per_host}", "--"] + worker
    label = f"{devices} device(s)" + (f" on {hosts} hosts" if hosts > 1 else "")
    print(f"[scaling] {label} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=None if args.verbose else subprocess.PIPE)
    results = []
    for line in proc.stdout.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[host ") else line
        if line.startswith("{"):
            results.append(json.loads(line))
    result = next((r for r in results if "tokens_per_sec" in r), None)
    base = {"devices": devices, "hosts": hosts, "mesh": mesh, "process_wall_s": time.perf_counter() - t}
    if proc.returncode or result is None:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()
        base["error"] = tail[-1] if tail else f"exit status {proc.returncode}"
        print(f"[scaling] {label}: failed: {base['error']}", file=sys.stderr, flush=True)
        return base
    print(f"[scaling] {label}: {result['tokens_per_sec']:,.0f} tokens/s", file=sys.stderr, flush=True)
    return {**base, **{k: result[k] for k in ("tokens_per_sec", "step_time_s", "loss", "traces")}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt_small", choices=("gpt_small", "bert_base", "resnet50"))
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--devices", default="1,2,4,8", help="logical device counts on one host")
    p.add_argument("--hosts", type=int, default=2, help="hosts for the multi-host point (1: none)")
    p.add_argument("--preset", default="data", help="sharding preset (tensor, 2d: with --model_parallel)")
    p.add_argument("--rules", default="", help="rules overrides, e.g. vocab=none (see train_throughput.py)")
    p.add_argument("--model_parallel", type=int, default=1,
                   help="size of the mesh's model axis on points with at least that many devices")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--steps_per_loop", type=int, default=2)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.devices.split(",") if n]
    if not counts or min(counts) < 1 or any(args.global_batch % n for n in counts):
        p.error(f"--devices={args.devices}: each count must be positive and divide --global_batch={args.global_batch}")
    points = [point(args, n) for n in counts]
    largest = max(counts)
    if args.hosts > 1:
        if largest % args.hosts:
            p.error(f"--hosts={args.hosts} must divide the largest device count {largest}")
        points.append(point(args, largest, args.hosts))
    one = next((q.get("tokens_per_sec") for q in points if q["devices"] == 1 and q["hosts"] == 1), None)
    for q in points:
        q["relative"] = q["tokens_per_sec"] / one if one and "tokens_per_sec" in q else None
    rate = lambda devices, hosts: next((q.get("tokens_per_sec") for q in points
                                        if q["devices"] == devices and q["hosts"] == hosts), None)
    multi, single = rate(largest, args.hosts), rate(largest, 1)
    print(json.dumps({
        "model": args.model, "num_layers": args.num_layers, "global_batch": args.global_batch,
        "seq_len": args.seq_len, "preset": args.preset, "rules": args.rules, "model_parallel": args.model_parallel, "steps": args.steps,
        "points": points,
        "relative_8": next((q["relative"] for q in points if q["devices"] == 8 and q["hosts"] == 1), None),
        "hosts_vs_one_host": multi / single if multi and single else None,
    }), flush=True)
    return 1 if any("error" in q for q in points) else 0


if __name__ == "__main__":
    sys.exit(main())
