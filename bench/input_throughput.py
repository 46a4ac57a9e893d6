"""Input pipeline throughput against the training step's consumption.

    python bench/input_throughput.py [--seconds=8] [--skip_gpt_small]

Measures, on this machine, in one run:
  1. one host's LM pipeline alone (stdlib corpus, SentencePiece in the graph, packing),
     as a separate process pinned to one CPU core: tokens/s and examples/s;
  2. two hosts (host 0 and 1 of 2) as two separate processes at once, each pinned to its
     own core, the way every host of a pod has its own CPUs: per-host tokens/s;
  3. the training step's consumption in tokens/s: lm_tiny on the default job's mesh
     (8 logical CPU devices, data:4,model:2) and gpt_small on one device (batch 2),
     both on synthetic batches so only the step is timed.

The last line is one JSON object with `input_over_step` (pipeline tokens/s over the
step's tokens/s, for the model that binds: the smallest ratio) and `per_host_scaling`
(mean per-host rate with 2 hosts over the 1-host rate).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pipeline_rate(num_hosts: int, host_id: int, seconds: float, host_rows: int, seq_len: int, vocab_size: int) -> dict:
    """Tokens/s and examples/s of one host's pipeline (this process), in steady state.

    Pulls batches for a 3 s warm-up (buffers fill, the tokenizer loads), then counts the
    batches pulled in the next `seconds`: long enough that what the prefetch and shuffle
    buffers held at the start is a small part of the count.
    """
    import tfpod  # noqa: F401
    from tfpod.input import lm_data
    from tfpod.input.common import ShardInfo

    data = lm_data.LMDataConfig(vocab_size=vocab_size)
    where = lm_data.resolve(data)
    ds = lm_data.lm_dataset(data, where.train_files, where.vocab_path, seq_len, host_rows,
                            ShardInfo(host_id, num_hosts), 0)
    it = iter(ds)
    end = time.perf_counter() + 3.0
    while time.perf_counter() < end:
        next(it)
    batches, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        next(it)
        batches += 1
    dt = time.perf_counter() - t
    return {"tokens_per_sec": batches * host_rows * seq_len / dt, "examples_per_sec": batches * host_rows / dt,
            "batches": batches}


def step_rate(gin_file: str, mesh: str, cpu_devices: int, params: list[str], steps: int) -> float:
    """Training tokens/s of a gin experiment on synthetic batches, after the first (compiling) window."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, os.path.join(ROOT, "main.py"), f"--gin_file={gin_file}", f"--mesh={mesh}",
               f"--cpu_devices={cpu_devices}", f"--model_dir={d}", "--gin_param=train.synthetic_data=True",
               f"--gin_param=train.steps={steps}", f"--gin_param=train.checkpoint_every={steps * 10}"]
        cmd += [f"--gin_param={p}" for p in params]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"step benchmark failed: {proc.stderr.strip().splitlines()[-1]}")
        records = [r for r in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if r["kind"] == "train"]
    rates = [r["tokens_per_sec"] for r in records[1:]] or [records[-1]["tokens_per_sec"]]
    return sum(rates) / len(rates)


def spawn_hosts(num_hosts: int, args) -> list[dict]:
    """Runs `num_hosts` pipeline processes at once, host h pinned to core h % cores."""
    cores = os.cpu_count() or 1
    procs = []
    for h in range(num_hosts):
        cmd = ["taskset", "-c", str(h % cores), sys.executable, os.path.abspath(__file__), "--worker",
               f"--num_hosts={num_hosts}", f"--host_id={h}", f"--seconds={args.seconds}",
               f"--host_rows={args.host_rows}", f"--seq_len={args.seq_len}", f"--vocab_size={args.vocab_size}"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode:
            raise SystemExit(f"pipeline worker failed: {stderr.strip().splitlines()[-1]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num_hosts", type=int, default=1)
    parser.add_argument("--host_id", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=8.0, help="measuring window per pipeline")
    parser.add_argument("--host_rows", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--skip_gpt_small", action="store_true")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(pipeline_rate(args.num_hosts, args.host_id, args.seconds, args.host_rows, args.seq_len,
                                       args.vocab_size)))
        return

    one = spawn_hosts(1, args)[0]
    two = spawn_hosts(2, args)
    per_host_two = sum(r["tokens_per_sec"] for r in two) / 2
    steps = {"lm_tiny": step_rate("gin/lm_tiny.gin", "data:4,model:2", 8, [], 40)}
    if not args.skip_gpt_small:
        steps["gpt_small"] = step_rate(
            "gin/gpt_small.gin", "data:1", 1,
            ["train.global_batch_size=2", "train.steps_per_loop=1", "train.log_every=1", "train.precision='float32'"], 4,
        )
    ratios = {k: one["tokens_per_sec"] / v for k, v in steps.items()}
    result = {
        "pipeline_tokens_per_sec": one["tokens_per_sec"],
        "pipeline_examples_per_sec": one["examples_per_sec"],
        "two_hosts_tokens_per_sec_per_host": [r["tokens_per_sec"] for r in two],
        "per_host_scaling": per_host_two / one["tokens_per_sec"],
        "step_tokens_per_sec": steps,
        "input_over_step_by_model": ratios,
        "input_over_step": min(ratios.values()),
        "seq_len": args.seq_len,
        "host_rows": args.host_rows,
        "cores": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
