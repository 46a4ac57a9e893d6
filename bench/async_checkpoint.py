"""Step time while a checkpoint is saved: synchronous against train.async_checkpoint=True.

    python bench/async_checkpoint.py [--steps=12] [--checkpoint_every=4] [--seq_len=128] [--verbose]

Each mode trains gpt_small (12 layers, 768 wide, vocab 50304: a 1.4 GiB checkpoint with
AdamW's slots) on 8 logical CPU devices under `tensor` (data:2,model:4), global batch 8,
one step per call of the compiled loop, saving every `checkpoint_every` steps, in its own
process. From metrics.jsonl's per-step records: the steady step time (steps after no
save), and the wall time of the steps that include a save (the step's own time plus the
save's blocking part: the whole write when synchronous, the copy of each host's own shards
off the devices when asynchronous (tfpod.checkpoint_writer); a background write also
competes with the next steps for this machine's 2 cores, which accelerators' hosts do
not).

The last line is one JSON object: {"sync": {...}, "async": {...}}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from workers import run_worker  # noqa: E402


def worker(args) -> dict:
    import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
    from tfpod import api

    params = ["train.synthetic_data=True", f"train.steps={args.steps}", "train.steps_per_loop=1", "train.log_every=1",
              f"train.checkpoint_every={args.checkpoint_every}", f"gpt.seq_len={args.seq_len}",
              "train.global_batch_size=8", "gpt.dropout=0.0", "gpt.attention_dropout=0.0",
              f"train.async_checkpoint={args.worker == 'async'}", "sharding.preset='tensor'"]
    d = tempfile.mkdtemp()
    lines = []  # tfpod's own log lines: what a save blocked for, and when its background write ended
    handler = logging.Handler()
    handler.emit = lambda record: lines.append((record.created, record.getMessage()))
    logging.getLogger("tfpod").addHandler(handler)
    logging.getLogger("tfpod").setLevel(logging.INFO)
    started = time.time()
    api.run(["gin/gpt_small.gin"], params, d, mode="train", mesh_spec="data:2,model:4", cpu_devices=8)
    wall = time.time() - started
    text = "\n".join(m for _, m in lines)
    records = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    times = {r["step"]: r["time"] for r in records if r["kind"] == "train"}
    steps = sorted(times)
    # a step's wall time: from the previous record to its own (includes a save after the previous step)
    dt = {s: times[s] - times[p] for p, s in zip(steps, steps[1:])}
    saved_before = [s for s in dt if (s - 1) % args.checkpoint_every == 0 and s - 1 > 0]
    plain = [v for s, v in dt.items() if s not in saved_before and s > 2]
    return {"mode": args.worker, "steady_step_s": statistics.median(plain),
            "step_after_save_s": statistics.median(dt[s] for s in saved_before),
            "steps": args.steps, "checkpoint_every": args.checkpoint_every, "run_wall_s": wall,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            # async: the copy off the devices each save blocked for, and each write's end after its step
            "copy_s": [float(m) for m in re.findall(r"copied off the devices in ([0-9.]+) s", text)],
            "written_after_s": [float(m) for m in re.findall(r"written in the background, ([0-9.]+) s", text)],
            # from a step's record to its save's return (the finite check, then the write or the copy)
            "save_blocked_s": [round(t - max(v for v in times.values() if v <= t), 2) for t, m in lines
                               if m.startswith(("saved checkpoint", "writing checkpoint")) and "background," not in m],
            "host_copy": re.findall(r"this host's (.+?) copied", text)[:1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--checkpoint_every", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    out = {}
    for mode in ("sync", "async"):
        out[mode] = run_worker([sys.executable, __file__, f"--worker={mode}", f"--steps={args.steps}",
                                f"--checkpoint_every={args.checkpoint_every}", f"--seq_len={args.seq_len}"],
                               "async_checkpoint", mode, ROOT, args.verbose, timeout=3600)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
