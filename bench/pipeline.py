"""Pipeline stages: the measured bubble, GPipe's and 1F1B's activation memory, tokens/s against data parallelism.

    python bench/pipeline.py [--parts=bubble,memory,equality,hosts] [--steps=5] [--verbose]

Every measurement is its own process (a fresh TensorFlow runtime); the model is a GPT
(4 blocks, embed 256, 8 heads, mlp 1024, vocab 2048) on synthetic batches.

  bubble   2 stages, one logical CPU device each (`stage:2,data:1`), TensorFlow's
           intra-op pool cut to 1 thread and its inter-op pool at 2, so each stage runs
           on its own core as stages on their own devices do. Microbatches of 4 rows x
           128 tokens, M in 1, 2, 4, 8 (global batch 4M). With M = 1 nothing overlaps:
           the step is p units u of one stage's forward and backward, u = T(1) / p; with
           M microbatches the stages are busy M u each, so the measured bubble is
           1 - M T(1) / (p T(M)), against GPipe's (p - 1) / (M + p - 1).
  memory   the same 2 stages, M = 8 microbatches of 8 rows x 256 tokens, GPipe against
           1F1B: the peak of the process's CPU allocator during a step above what it
           held before the step (the weights, optimizer state and batch), over the 2
           devices (logical CPU devices share one allocator, so this is both stages'
           activations together, and per device their mean), against the schedules'
           activations alive at once (schedules.in_flight: M per stage for GPipe, p - s
           for 1F1B).
  equality every M in 1, 2, 4, 8 on `stage:2,data:4`, `stage:2,data:2,model:2` and
           `stage:4,data:2`, under both schedules, against `data:8` (8 logical devices, one
           process; the tests' model and settings, global batch 32): the largest relative loss difference
           over 4 steps (tests/test_pipeline.py runs a subset of these in the suite).
  hosts    2 local hosts x 2 devices through tfpod.launch: `stage:2,data:2` (1F1B, M=4)
           against `data:4`, tokens/s from metrics.jsonl (the mean after the compiling
           step). Each host holds one device of each stage (DTensor copies between
           meshes only within a host: tfpod.partitioning.stages), so the stages' copies
           stay inside a process and the hosts exchange the data-parallel gradients.

The last line is one JSON object: {"bubble": [...], "memory": {...}, "equality": {...}, "hosts": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from workers import run_worker  # bench/workers.py (scripts run from bench/)

# The CPU allocator's peak comes from tf.config.experimental.get_memory_info, which the default
# CPU allocator does not track on the Eigen path (an AMD EPYC without AVX-512: "Cannot reset
# memory stats for device 'CPU:0'"); the BFC allocator tracks it on every CPU. Set before
# TensorFlow loads, here and (inherited) in the workers.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(vocab_size=2048, num_layers=4, embed_dim=256, num_heads=8, mlp_dim=1024)


def equality_worker() -> dict:
    """Every mesh x M x schedule against data:8, in this process (8 logical devices)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import numpy as np

    import tfpod  # noqa: F401
    from tfpod import runtime

    runtime.initialize(cpu_devices=8, device_type="CPU")
    from test_pipeline import make  # the tests' model, batch and optimizer

    reference = np.array(make(tempfile.mkdtemp(), "data:8", batch=32).train()["losses"])
    out = {}
    for spec in ("stage:2,data:4", "stage:2,data:2,model:2", "stage:4,data:2"):
        for m in (1, 2, 4, 8):
            for schedule in ("gpipe", "1f1b"):
                losses = np.array(make(tempfile.mkdtemp(), spec, m, schedule, batch=32).train()["losses"])
                out[f"{spec} M={m} {schedule}"] = float(np.max(np.abs(losses - reference) / np.abs(reference)))
    return {"max_relative_difference": out, "worst": max(out.values())}


def worker(args) -> dict:
    """One pipelined run in this process: step times, and the allocator's peak during a step."""
    import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    from tfpod import runtime

    runtime.initialize(cpu_devices=2, device_type="CPU")
    import numpy as np

    from tfpod import api, controller, mesh as meshlib, optimizers, partitioning
    from tfpod.models import gpt

    seq_len = 256 if args.worker == "memory" else 128
    rows = 8 if args.worker == "memory" else 4
    config = gpt.GPTConfig(seq_len=seq_len, **MODEL)
    batch = rows * args.microbatches
    train = controller.TrainConfig(steps=args.steps + 1, global_batch_size=batch, steps_per_loop=1, log_every=1000,
                                   checkpoint_every=10_000, synthetic_data=True, microbatches=args.microbatches)
    placement = partitioning.Placement.from_config(partitioning.ShardingConfig(preset="data"), "data",
                                                   meshlib.make_stage_meshes("stage:2,data:1"), check=False)
    run = api.controller(gpt.TASK, config, train, optimizers.OptimizerConfig(warmup_steps=0), placement,
                         tempfile.mkdtemp(), schedule=args.schedule)
    trainer = run.trainer
    host = gpt.TASK.synthetic_batch(config, batch, np.random.default_rng(0))
    stack = {k: v[None] for k, v in host.items()}
    trainer.train_loop(stack, 1)  # compiles
    times, peaks = [], []
    for _ in range(args.steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        t = time.perf_counter()
        trainer.train_loop(stack, 1)
        times.append(time.perf_counter() - t)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    return {"schedule": args.schedule, "microbatches": args.microbatches, "step_s": statistics.median(times),
            "activation_bytes": int(statistics.median(peaks)), "tokens_per_step": batch * seq_len}


def bubble(args) -> list[dict]:
    from tfpod.pipeline import schedules

    out, base = [], None
    for m in (1, 2, 4, 8):
        r = run_worker([sys.executable, __file__, "--worker=bubble", f"--microbatches={m}", "--schedule=gpipe",
                        f"--steps={args.steps}"], "pipeline", f"bubble M={m}", ROOT, args.verbose)
        if "error" in r:
            out.append({"microbatches": m, "error": r["error"]})
            continue
        base = r["step_s"] if m == 1 else base
        measured = 1 - m * base / (2 * r["step_s"]) if base else None
        out.append({"microbatches": m, "step_s": round(r["step_s"], 4),
                    "measured_bubble": None if measured is None else round(measured, 3),
                    "theoretical_bubble": round(schedules.bubble_fraction(2, m), 3)})
    return out


def memory(args) -> dict:
    from tfpod.pipeline import schedules

    out = {}
    for name in ("gpipe", "1f1b"):
        r = run_worker([sys.executable, __file__, "--worker=memory", "--microbatches=8", f"--schedule={name}",
                        f"--steps={args.steps}"], "pipeline", f"memory {name}", ROOT, args.verbose)
        if "error" in r:
            out[name] = r
            continue
        alive = [schedules.in_flight(a) for a in schedules.schedule(name, 2, 8)]
        out[name] = {"activation_mib_both_stages": round(r["activation_bytes"] / 2**20, 1),
                     "activation_mib_per_device": round(r["activation_bytes"] / 2 / 2**20, 1),
                     "microbatches_alive_per_stage": alive, "step_s": round(r["step_s"], 3)}
    if "gpipe" in out and "1f1b" in out and "error" not in out["gpipe"] and "error" not in out["1f1b"]:
        out["gpipe_over_1f1b"] = round(out["gpipe"]["activation_mib_both_stages"]
                                       / max(out["1f1b"]["activation_mib_both_stages"], 1e-9), 2)
    return out


def hosts(args) -> dict:
    out = {}
    runs = {"pipeline": ("stage:2,data:2", ["train.microbatches=4", "sharding.pipeline_schedule='1f1b'"]),
            "data": ("data:4", [])}
    for name, (mesh, extra) in runs.items():
        d = tempfile.mkdtemp()
        params = [f"gpt.{k}={v}" for k, v in MODEL.items()] + [
            "gpt.seq_len=128", "train.global_batch_size=16", f"train.steps={args.steps * 4}", "train.log_every=1",
            "train.steps_per_loop=1", "train.checkpoint_every=10000", "train.synthetic_data=True",
            "sharding.preset='data'", *extra]
        cmd = [sys.executable, "-m", "tfpod.launch", "--num_hosts=2", "--devices_per_host=2", "--", sys.executable,
               "main.py", "--gin_file=gin/lm_tiny.gin", f"--mesh={mesh}", f"--model_dir={d}"]
        cmd += [f"--gin_param={p}" for p in params]
        print(f"[pipeline] hosts {name} ...", file=sys.stderr, flush=True)
        import subprocess

        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        if proc.returncode:
            out[name] = {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1]}
            continue
        rates = [json.loads(l)["tokens_per_sec"] for l in open(os.path.join(d, "metrics.jsonl"))
                 if json.loads(l).get("kind") == "train"][1:]
        out[name] = {"mesh": mesh, "tokens_per_sec": round(statistics.mean(rates), 1)}
    if all("tokens_per_sec" in out.get(n, {}) for n in runs):
        out["pipeline_over_data"] = round(out["pipeline"]["tokens_per_sec"] / out["data"]["tokens_per_sec"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="bubble,memory,equality,hosts")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--worker", choices=("bubble", "memory", "equality"), help=argparse.SUPPRESS)
    p.add_argument("--microbatches", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--schedule", default="gpipe", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(equality_worker() if args.worker == "equality" else worker(args)))
        return
    sys.path.insert(0, ROOT)
    equality = lambda a: run_worker([sys.executable, __file__, "--worker=equality"], "pipeline", "equality", ROOT,
                                    a.verbose)
    parts = {"bubble": bubble, "memory": memory, "equality": equality, "hosts": hosts}
    result = {name: parts[name](args) for name in args.parts.split(",")}
    result["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
