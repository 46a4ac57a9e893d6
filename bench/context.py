"""Context parallelism on 8 logical CPU devices: memory and step time of `context:C,data:8/C`
against `data:8`, with the planner's numbers beside them.

    python bench/context.py [--chunks=1,2,4,8] [--length=4096] [--steps=3]

Each run trains a small GPT (2 layers, embed 128, 4 heads, MLP 512, vocab 2048, fp32,
blockwise attention with 512-token blocks, synthetic tokens) at `--length` tokens for
`--steps` steps after the first (which compiles), with one sequence per data shard: a global
batch of 8 / C sequences on `context:C,data:8/C` (C = 1: `data:8`, 8 sequences). That is
long-context training's regime (a sequence per data replica; context parallelism is what
lets a longer one fit), so each device holds length / C tokens of one sequence: its
activations should fall about 1/C. (At a fixed global batch every mesh of 8 devices holds
the same tokens per device: the planner's `data:8` and `context:2,data:4` activations then
differ only by the gathered keys and values; see docs/attention.md.)

Measured per run, in its own process (main.py): peak RSS (os.wait4) and the step time
(median of metrics.jsonl's steps after the first). The process holds all 8 devices, so the
devices' activations together are the peak less the same mesh's run at 64 tokens (the
runtime, the weights and the optimizer state, which do not grow with the sequence); per
device, that divided by 8. Beside each: the planner's activation and temporary bytes per
device and step time for the same run (tfpod.plan.predict, device "cpu").

The last line is one JSON object: {"runs": [{"mesh", "chunks", "global_batch", "length",
"peak_rss_gib", "base_rss_gib", "activation_mib_per_device", "step_s", "tokens_per_s",
"planned_activation_mib", "planned_temporary_mib", "planned_step_s"}], "length"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from attention import ROOT, available_gib, measure

MODEL = ["gpt.num_layers=2", "gpt.embed_dim=128", "gpt.num_heads=4", "gpt.mlp_dim=512", "gpt.vocab_size=2048",
         "gpt.dropout=0.0", "gpt.attention_dropout=0.0", "train.synthetic_data=True", "train.steps_per_loop=1",
         "train.log_every=1", "train.checkpoint_every=1000", "optimizer.warmup_steps=0", "attention.block_size=512"]


def mesh_of(chunks: int) -> str:
    return "data:8" if chunks == 1 else f"context:{chunks},data:{8 // chunks}"


def params(chunks: int, length: int, steps: int) -> list:
    return MODEL + [f"gpt.seq_len={length}", f"train.global_batch_size={8 // chunks}", f"train.steps={steps}"]


def run_main(chunks: int, length: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, os.path.join(ROOT, "main.py"), "--gin_file=gin/lm_tiny.gin", "--cpu_devices=8",
               f"--mesh={mesh_of(chunks)}", f"--model_dir={d}", "--nopreflight"] + [
                   f"--gin_param={p}" for p in params(chunks, length, steps)]
        result = measure(cmd, 0.8 * available_gib())
    if result["returncode"] != 0:
        raise SystemExit(f"bench/context.py: {mesh_of(chunks)} at {length} tokens failed: "
                         f"{(result['err'].strip().splitlines() or ['?'])[-1][:300]}")
    tokens = (8 // chunks) * length
    result["step_s"] = statistics.median(
        tokens / r["tokens_per_sec"] for r in result["records"] if r.get("kind") == "train" and r["step"] > 1)
    return result


def planned(chunks: int, length: int) -> dict:
    sys.path.insert(0, ROOT)
    from tfpod import api, plan

    with tempfile.TemporaryDirectory() as d:
        configs = api.load_configs(["gin/lm_tiny.gin"], params(chunks, length, 2), d)
        return plan.predict(configs, mesh_of(chunks), device="cpu", num_devices=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.chdir(ROOT)
    runs = []
    for chunks in (int(c) for c in args.chunks.split(",")):
        full = run_main(chunks, args.length, 1 + args.steps)
        base = run_main(chunks, 64 * chunks, 2)  # the same mesh, a sequence of 64 tokens (8 per chunk half)
        p = planned(chunks, args.length)
        runs.append({
            "mesh": mesh_of(chunks), "chunks": chunks, "global_batch": 8 // chunks, "length": args.length,
            "peak_rss_gib": round(full["peak_rss_gib"], 3), "base_rss_gib": round(base["peak_rss_gib"], 3),
            "activation_mib_per_device": round((full["peak_rss_gib"] - base["peak_rss_gib"]) * 1024 / 8, 1),
            "step_s": round(full["step_s"], 3), "tokens_per_s": round((8 // chunks) * args.length / full["step_s"], 1),
            "planned_activation_mib": round(p["activation_bytes"] / 2 ** 20, 1),
            "planned_temporary_mib": round(p["temporary_bytes"] / 2 ** 20, 1),
            "planned_step_s": round(p["step_time_s"], 3)})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"runs": runs, "length": args.length}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
