"""How close the planner (tfpod.plan) comes to what runs measure, and to published runs.

    python bench/plan_accuracy.py [--parts=state,memory,time,published] [--verbose]

state      Weights and optimizer bytes per device, planned against the layouts a real
           Trainer builds (layouts.txt's totals), for lm_tiny, gpt_small, BERT, ResNet-50
           and MoE tiny on 8 logical CPU devices: equal, to the byte.
memory     Each model trains in its own process on one CPU device; the CPU allocator's
           peak during a step, above what the process held before it (the weights and
           optimizer state, the batch), against the planned gradients + activations +
           temporaries; and the whole peak against the planned total.
time       bench/presets.py's presets (gpt_small, 2 layers, length 128, global batch 8,
           on 8 logical devices) measured, against the plan on `cpu` (this machine,
           measured: its matmul peaks and memory bandwidth shared by the 8 devices).
published  Megatron-LM's GPT-3 runs and MaxText's v5p table beside tfpod's plans of the
           same model, batch and devices: Megatron's own memory formulas
           (theoretical_memory_usage.py: 18 bytes per parameter for weights, gradients
           and Adam; activations 34 s b h / t per layer with sequence parallelism and
           selective recomputation) and the MFU each reports.

The last line is one JSON object: {"state": [...], "memory": [...], "time": [...], "published": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# The CPU allocator's peak comes from tf.config.experimental.get_memory_info, which the default
# CPU allocator does not track on the Eigen path (an AMD EPYC without AVX-512: "Cannot reset
# memory stats for device 'CPU:0'"); the BFC allocator tracks it on every CPU. Set before
# TensorFlow loads, here and (inherited) in the workers.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from workers import run_worker  # noqa: E402

# (name, gin file, bindings, mesh for the state check, preset)
MODELS = [
    ("lm_tiny", "gin/lm_tiny.gin", [], "data:4,model:2", "tensor"),
    ("gpt_small", "gin/gpt_small.gin", ["train.global_batch_size=8", "gpt.seq_len=256"], "data:4,model:2", "2d"),
    ("bert_tiny", "gin/bert_tiny.gin", [], "data:4,model:2", "tensor"),
    ("resnet50", "gin/resnet50.gin", ["train.global_batch_size=8", "train.steps=10"], "data:8", "weight_update"),
    ("moe_tiny", "gin/moe_tiny.gin", [], "data:2,expert:4", "tensor"),
]
MEMORY_TOLERANCE = 0.25
TIME_TOLERANCE = 0.30


def _configs(gin: str, params: list):
    from tfpod import api, config

    config.parse_config([gin], ["train.synthetic_data=True"] + params)
    return api.build_run_configs()


def state_part() -> list:
    """Planned weights/optimizer bytes per device against a built Trainer's, 8 devices."""
    from tfpod import api, mesh as meshlib, partitioning, runtime
    from tfpod.plan import devices
    from tfpod.plan.planner import Choice, Planner

    runtime.initialize(cpu_devices=8, device_type="CPU")
    rows = []
    for name, gin, params, mesh, preset in MODELS:
        c = _configs(gin, params + [f"sharding.preset='{preset}'"])
        placement = partitioning.Placement.from_config(c.sharding, c.task.default_preset,
                                                       meshlib.make_stage_meshes(mesh), attention=c.attention)
        t = api.controller(c.task, c.model, c.train, c.optimizer, placement, tempfile.mkdtemp()).trainer
        built = lambda specs, layouts: sum(partitioning.bytes_per_device(s.shape, s.dtype, layouts[s.name])
                                           for s in specs)
        planned = Planner(c, devices.get("h100"), 8).plan(Choice(mesh))["per_device_bytes"]
        row = {"model": name, "mesh": mesh, "preset": preset,
               "weights_built": built(t.specs, t.layouts), "weights_planned": planned["weights"],
               "optimizer_built": built(t.state_specs, t.state_layouts), "optimizer_planned": planned["optimizer"]}
        row["equal"] = (row["weights_built"] == row["weights_planned"]
                        and row["optimizer_built"] == row["optimizer_planned"])
        rows.append(row)
        print(f"[plan_accuracy] state {name}: {row}", file=sys.stderr, flush=True)
    return rows


def memory_worker(name: str) -> dict:
    """One model on one CPU device: the allocator's peak during a step, and the plan."""
    import numpy as np
    import tensorflow as tf

    from tfpod import api, mesh as meshlib, partitioning, runtime
    from tfpod.plan import devices
    from tfpod.plan.planner import Choice, Planner

    runtime.initialize(cpu_devices=1, device_type="CPU")
    _, gin, params, _, _ = next(m for m in MODELS if m[0] == name)
    c = _configs(gin, params + ["sharding.preset='data'", "train.steps_per_loop=1"])
    planned = Planner(c, devices.get("h100", 1), 1).plan(Choice("data:1"))
    placement = partitioning.Placement.from_config(c.sharding, c.task.default_preset,
                                                   meshlib.make_stage_meshes("data:1"), attention=c.attention)
    run = api.controller(c.task, c.model, c.train, c.optimizer, placement, tempfile.mkdtemp(), c.data)
    trainer = run.trainer
    host = c.task.synthetic_batch(c.model, c.train.global_batch_size, np.random.default_rng(0))
    stack = {k: v[None] for k, v in host.items()}
    trainer.train_loop(stack, 1)  # compiles
    peaks, befores, times = [], [], []
    for _ in range(2):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        t = time.perf_counter()
        trainer.train_loop(stack, 1)
        times.append(time.perf_counter() - t)
        befores.append(before)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    b = planned["per_device_bytes"]
    step_peak = int(statistics.median(p - q for p, q in zip(peaks, befores)))
    return {"model": name, "global_batch": c.train.global_batch_size,
            "measured_step_peak": step_peak, "measured_peak": int(statistics.median(peaks)),
            "measured_held_before": int(statistics.median(befores)),
            "planned_step_peak": b["gradients"] + b["activations"] + b["temporary"], "planned_total": b["total"],
            "planned": b}


def memory_part(verbose: bool) -> list:
    rows = []
    for name, *_ in MODELS:
        r = run_worker([sys.executable, __file__, f"--worker=memory:{name}"], "plan_accuracy", f"memory {name}", ROOT,
                       verbose, timeout=1800)
        if "error" not in r:
            r["step_peak_ratio"] = r["planned_step_peak"] / r["measured_step_peak"]
            r["total_ratio"] = r["planned_total"] / r["measured_peak"]
            r["within_25%"] = abs(r["step_peak_ratio"] - 1) <= MEMORY_TOLERANCE and \
                abs(r["total_ratio"] - 1) <= MEMORY_TOLERANCE
        else:
            r["model"] = name
        rows.append(r)
        print(f"[plan_accuracy] memory {name}: {r}", file=sys.stderr, flush=True)
    return rows


def time_part(verbose: bool, presets_json: str | None) -> list:
    """bench/presets.py's step times against the plan on this measured CPU."""
    from tfpod import api, config as configlib, controller, optimizers, partitioning
    from tfpod.models import gpt
    from tfpod.plan import devices
    from tfpod.plan.planner import Choice, Planner

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import presets as presets_bench

    if presets_json:
        with open(presets_json) as f:  # bench/presets.py's output: its last line is the JSON
            measured = json.loads([line for line in f if line.startswith("{")][-1])
    else:
        print("[plan_accuracy] time: python bench/presets.py --num_layers=2 ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "presets.py"), "--num_layers=2"], cwd=ROOT,
                             text=True, stdout=subprocess.PIPE, stderr=None if verbose else subprocess.PIPE)
        measured = json.loads(out.stdout.strip().splitlines()[-1])
    cpu = devices.get("cpu", 8)
    rows = []
    for preset, r in measured["presets"].items():
        if "step_time_s" not in r:
            rows.append({"preset": preset, "error": r.get("error", "no step time")})
            continue
        model = gpt.GPTConfig(**{**presets_bench.GPT_SMALL, "num_layers": 2}, seq_len=measured["seq_len"])
        c = api.RunConfigs(task=gpt.TASK, experiment=configlib.ExperimentConfig(model="gpt"), model=model, data=None,
                           train=controller.TrainConfig(steps=3, global_batch_size=measured["global_batch"]),
                           optimizer=optimizers.OptimizerConfig(learning_rate=6e-4, warmup_steps=0),
                           sharding=partitioning.ShardingConfig(preset=preset))
        p = Planner(c, cpu, 8).plan(Choice(r["mesh"]))
        ratio = p["step_time_s"] / r["step_time_s"]
        rows.append({"preset": preset, "mesh": r["mesh"], "measured_step_s": r["step_time_s"],
                     "planned_step_s": p["step_time_s"], "ratio": ratio,
                     "within_30%": abs(ratio - 1) <= TIME_TOLERANCE, "planned_breakdown": p["breakdown"]["time"]})
        print(f"[plan_accuracy] time {preset}: measured {r['step_time_s']:.3f} s, planned {p['step_time_s']:.3f} s",
              file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="state,memory,time,published")
    parser.add_argument("--presets_json", default=None, help="time: a saved bench/presets.py JSON line instead of a run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)

    if args.worker:
        print(json.dumps(memory_worker(args.worker.split(":", 1)[1])))
        return
    from plan_published import published_part

    parts = args.parts.split(",")
    out = {}
    if "state" in parts:  # first: it starts this process's runtime on 8 logical devices
        out["state"] = state_part()
    if "memory" in parts:
        out["memory"] = memory_part(args.verbose)
    if "time" in parts:
        out["time"] = time_part(args.verbose, args.presets_json)
    if "published" in parts:
        out["published"] = published_part()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
