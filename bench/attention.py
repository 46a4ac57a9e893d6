"""Peak memory and step time of blockwise against materialized attention, by sequence length.

    python bench/attention.py [--lengths=1024,4096,16384] [--implementations=blockwise,materialized]
                              [--steps=3] [--limit_gib=12] [--max_rss_gib=0]

Each (implementation, length) trains a small GPT (2 layers, embed 256, 4 heads, MLP 1024,
vocab 2048, fp32, batch 1, synthetic tokens) on one CPU device with main.py in its own
process, so the process's peak RSS (`ru_maxrss`, from os.wait4) is that run's alone:
TensorFlow's runtime, the weights and AdamW state, and what the step keeps and allocates.
The step time is the median of the steps after the first (which compiles), from
metrics.jsonl's tokens per second (one record per step). A process whose RSS passes --max_rss_gib (default:
80% of the memory available at its start) is stopped: that length does not fit here.

"longest under the limit": per implementation, the longest length of those run whose peak
RSS stayed under --limit_gib (the memory limit stated here: a device of that size), lengths
doubling from the shortest; a run stopped or failed counts as over it.

The last line is one JSON object: {"runs": [{"implementation", "length", "peak_rss_gib",
"step_s", "tokens_per_s", "fits"}], "longest_under_limit": {implementation: length},
"limit_gib", "block_size"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["gpt.num_layers=2", "gpt.embed_dim=256", "gpt.num_heads=4", "gpt.mlp_dim=1024", "gpt.vocab_size=2048",
         "gpt.dropout=0.0", "gpt.attention_dropout=0.0", "train.global_batch_size=1", "train.synthetic_data=True",
         "train.steps_per_loop=1", "train.log_every=1", "train.checkpoint_every=1000", "optimizer.warmup_steps=0"]


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] / 2 ** 20


def rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return 0.0


def measure(cmd: list, max_rss: float) -> dict:
    """Runs `cmd` (main.py with a --model_dir) in its own process: its peak RSS (GiB, from
    os.wait4), its metrics.jsonl records, exit code, whether it passed `max_rss` (stopped)."""
    model_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--model_dir="))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stopped = []

    def watch():
        while proc.poll() is None:
            if rss_gib(proc.pid) > max_rss:
                stopped.append(True)
                proc.kill()
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    records = []
    if os.path.exists(os.path.join(model_dir, "metrics.jsonl")):
        records = [json.loads(l) for l in open(os.path.join(model_dir, "metrics.jsonl"))]
    return {"peak_rss_gib": usage.ru_maxrss / 2 ** 20, "records": records, "stopped": bool(stopped),
            "returncode": os.waitstatus_to_exitcode(status), "err": err}


def one(impl: str, length: int, steps: int, block: int, max_rss: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, os.path.join(ROOT, "main.py"), "--gin_file=gin/lm_tiny.gin", "--cpu_devices=1",
               "--mesh=data:1", f"--model_dir={d}", "--nopreflight"] + [f"--gin_param={p}" for p in MODEL + [
                   f"gpt.seq_len={length}", f"train.steps={1 + steps}", f"attention.implementation='{impl}'",
                   f"attention.block_size={block}"]]
        result = measure(cmd, max_rss)
    times = [length / r["tokens_per_sec"] for r in result["records"] if r.get("kind") == "train" and r["step"] > 1]
    out = {"implementation": impl, "length": length, "peak_rss_gib": round(result["peak_rss_gib"], 2),
           "fits": result["returncode"] == 0 and not result["stopped"]}
    if times:
        out["step_s"] = round(statistics.median(times), 3)
        out["tokens_per_s"] = round(length / out["step_s"], 1)
    if not out["fits"]:
        out["why"] = "stopped past --max_rss_gib" if result["stopped"] else (
            result["err"].strip().splitlines() or ["?"])[-1][:300]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--implementations", default="blockwise,materialized")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--block_size", type=int, default=512)
    parser.add_argument("--limit_gib", type=float, default=12.0)
    parser.add_argument("--max_rss_gib", type=float, default=0.0)
    args = parser.parse_args()
    runs = []
    for impl in args.implementations.split(","):
        for length in sorted(int(x) for x in args.lengths.split(",")):
            max_rss = args.max_rss_gib or 0.8 * available_gib()
            runs.append(one(impl, length, args.steps, args.block_size, max_rss))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    longest = {}
    for impl in args.implementations.split(","):
        ok = [r["length"] for r in runs if r["implementation"] == impl and r["fits"] and r["peak_rss_gib"] < args.limit_gib]
        longest[impl] = max(ok) if ok else None
    print(json.dumps({"runs": runs, "longest_under_limit": longest, "limit_gib": args.limit_gib,
                      "block_size": args.block_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
