"""Spatial partitioning against data parallelism: step time and per-device activation memory.

    python bench/spatial.py [--model=resnet|ssd] [--image_size=128] [--global_batch=8]
                            [--steps=3] [--runs=data8,spatial,data2] [--verbose]

Each run is its own process (a fresh TensorFlow runtime) training the tiny model of
`--model` (resnet: gin/resnet50_tiny.gin's model; ssd: gin/ssd_tiny.gin's; at --image_size)
on synthetic batches of the same global batch from the same seed:

  data8     preset data on data:8 (8 logical CPU devices): 1/8 of the batch per device
  spatial   preset spatial on data:2,model:4 (8 devices): 1/2 of the batch per replica,
            each image's rows split over 4 devices
  data2     preset data on data:2 (2 logical CPU devices): the same 2 replicas as
            `spatial`, each on one device: what spatial partitioning divides

Per-device activation bytes: the outputs of every convolution and pooling layer (batch
norm and ReLU outputs have the same shapes) as one device holds them, summed over the
layers of one forward pass (tfpod.partitioning.spatial.recording); halo rows and the
im2col patches, temporaries of one layer at a time, are not in it. On logical CPU
devices every device shares the process's allocator, so no per-device peak can be
read there. Step time: mean of the timed steps after the compiling one (metrics.jsonl).
Every run's losses are compared with data8's (relative difference; spatial must agree
to 1e-4).

The last line is one JSON object: {"model", "image_size", "global_batch", "runs": {name: {...}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from workers import run_worker  # bench/workers.py (scripts run from bench/)

RUNS = {"data8": (8, "data:8", "data"), "spatial": (8, "data:2,model:4", "spatial"), "data2": (2, "data:2", "data")}
LOSS_RTOL = 1e-4


def measure(args) -> dict:
    """One run in this process: activation bytes per device from the traced layers, step time, losses."""
    import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
    from tfpod import runtime

    cpu_devices, spec, preset = RUNS[args.run]
    runtime.initialize(cpu_devices=cpu_devices, device_type="CPU")
    from tfpod import api, controller, mesh as meshlib, optimizers, partitioning
    from tfpod.models import get_task
    from tfpod.partitioning import spatial

    task = get_task(args.model)
    model_cfg = _model_config(task, args)
    mesh = meshlib.make_mesh(spec)
    placement = partitioning.Placement.from_config(partitioning.ShardingConfig(preset=preset), task.default_preset,
                                                   mesh, check=False)
    train_cfg = controller.TrainConfig(steps=1 + args.steps, global_batch_size=args.global_batch, seed=1,
                                       steps_per_loop=1, log_every=1, checkpoint_every=10**9, synthetic_data=True)
    opt_cfg = optimizers.OptimizerConfig(name="sgd", learning_rate=0.05, warmup_steps=0, momentum=0.9,
                                         weight_decay=0.0, clip_norm=0)
    with tempfile.TemporaryDirectory() as model_dir:
        run = api.controller(task, model_cfg, train_cfg, opt_cfg, placement, model_dir)
        run.checkpoints.save = lambda **kwargs: None  # not measured
        with spatial.recording() as records:
            result = run.train()
        steps = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    first = {}
    for r in records:  # one forward pass: a layer's first record (later traces repeat it)
        first.setdefault(r["id"], r)
    ends = [s["time"] for s in steps if s.get("kind") == "train"]  # one record per step
    times = [b - a for a, b in zip(ends, ends[1:])]  # the steps after the first (compiling) one
    return {
        "mesh": spec, "preset": preset, "devices": cpu_devices,
        "activation_bytes_per_device": sum(r["bytes_per_device"] for r in first.values()),
        "layers": len(first), "layers_rows_split": sum(r["rows_split"] for r in first.values()),
        "step_time_s": sum(times) / len(times) if times else None,
        "losses": [float(x) for x in result["losses"]],
    }


def _model_config(task, args):
    """The tiny config's model, at --image_size when given."""
    from tfpod.config import build_config, parse_config

    gin_file = {"resnet": "gin/resnet50_tiny.gin", "ssd": "gin/ssd_tiny.gin"}[args.model]
    parse_config([gin_file], [f"{task.name}.image_size={args.image_size}"] if args.image_size else [])
    return build_config(task.name)


def run_one(name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", f"--run={name}", f"--model={args.model}",
           f"--image_size={args.image_size}", f"--global_batch={args.global_batch}", f"--steps={args.steps}"]
    return run_worker(cmd, "spatial", name, os.path.dirname(os.path.dirname(os.path.abspath(__file__))), args.verbose,
                      args.timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--model", default="resnet", choices=("resnet", "ssd"))
    parser.add_argument("--image_size", type=int, default=128, help="0: the tiny config's")
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the compiling one")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args)))
        return
    names = [n for n in args.runs.split(",") if n]
    if any(n not in RUNS for n in names):
        raise SystemExit(f"error: --runs={args.runs}: use some of {', '.join(RUNS)}")
    results = {n: run_one(n, args) for n in names}
    ref = results.get("data8", {}).get("losses")
    for name, r in results.items():
        if ref and "losses" in r:
            r["loss_rel_diff_vs_data8"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        if "activation_bytes_per_device" in r:
            print(f"{name:8s} {r['mesh']:15s} step {r['step_time_s']:.3f} s  activations/device "
                  f"{r['activation_bytes_per_device'] / 2**20:8.2f} MiB  rows split in {r['layers_rows_split']} of "
                  f"{r['layers']} layers  loss diff vs data8 {r.get('loss_rel_diff_vs_data8', float('nan')):.1e}")
        else:
            print(f"{name:8s} {r.get('error')}")
    print(json.dumps({"model": args.model, "image_size": args.image_size, "global_batch": args.global_batch,
                      "timed_steps": args.steps, "cores": os.cpu_count(), "runs": results}))
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
