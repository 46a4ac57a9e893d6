"""Soak: train_and_eval under random kills and relaunches, checked against an uninterrupted run.

    python bench/soak.py [--seconds=600] [--steps=60] [--hosts=1] [--min_gap=3] [--max_gap=20] [--faults=N]
        [--memory_every=N] [--sigterm_fraction=0.25] [--seed=0] [--out=runs/soak]

First an uninterrupted reference: `main.py --mode=train_and_eval` on the default corpus
(a small GPT with dropout, real tokenized and packed input, an eval every few steps, a
checkpoint every few steps). Then the same command again and again in another folder:
each launch is killed after a random time (SIGKILL, or with --sigterm_fraction a
preemption SIGTERM, after which the run must save and exit 0) and relaunched, until
--seconds have passed; the last launch then runs to the end. With --hosts=2 every launch
is `tfpod.launch` with 2 local hosts and a SIGKILL hits one random host (the launcher
then stops the other), as when a machine of a pod dies.

Checks, against the reference: each step's loss (metrics.jsonl; a step replayed after a
kill counts with its last value), each eval's metrics, and every value in the final
checkpoint (weights and optimizer slots). The last line is one JSON object:
{"kills", "sigterms", "launches", "steps", "max_loss_rel_dev", "max_eval_rel_dev",
"max_weight_abs_dev", "exact" (every deviation within 1e-6), "seconds", "goodput" (the run's
own account over all its launches, tfpod.goodput: goodput and badput by cause),
"reference_goodput", ...}; the script exits 1 when a launch fails for another reason or
the run is not exact.

With --faults=N it injects faults instead of killing (tfpod.faults, TFPOD_FAULT): N faults,
the kinds exception, kill, hang, nonfinite, ckpt_fail, ckpt_truncate and slow (0.3 s before
every call until the next restart) in turn, at seeded random steps and hosts, in one run under
`tfpod.launch --max_restarts` (the hang watchdog at 5 s); the JSON adds "faults_fired",
"kinds", "restarts", "steps_trained_again_per_fault" (per fault that ended a launch),
"memory_restores" and "recovery_s_per_fault" (from a failed launch's last record to its
successor's first steady step, tfpod.goodput's records). --memory_every=N adds in-memory
snapshots (train.memory_checkpoint_every): restarts then read memory where it is newer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main_command(args, model_dir: str, eval_file: str) -> list[str]:
    params = ["gpt.num_layers=1", "gpt.dropout=0.1", "gpt.attention_dropout=0.1", "sharding.preset='data'",
              f"train.steps={args.steps}", "train.global_batch_size=16", "train.steps_per_loop=1", "train.log_every=1",
              f"train.checkpoint_every={args.checkpoint_every}", f"train.eval_every={args.eval_every}",
              f"train.seed={args.seed}", "optimizer.warmup_steps=0", f"optimizer.decay_steps={args.steps}",
              f"lm_data.eval_files='{eval_file}'", f"train.memory_checkpoint_every={args.memory_every}"]
    main = [sys.executable, os.path.join(ROOT, "main.py"), "--gin_file=gin/lm_tiny.gin", "--mesh=data:8",
            "--mode=train_and_eval", f"--model_dir={model_dir}"] + [f"--gin_param={p}" for p in params]
    if args.hosts == 1:
        return main + ["--cpu_devices=8"]
    return [sys.executable, "-m", "tfpod.launch", f"--num_hosts={args.hosts}",
            f"--devices_per_host={8 // args.hosts}", "--"] + main


def first_eval_file() -> str:
    """One eval shard of the default corpus (prepared on first use)."""
    import glob

    from tfpod.input import prepare

    return sorted(glob.glob(prepare.split_paths(prepare.ensure(), "eval")))[0]


def records(model_dir: str, kind: str) -> dict[int, dict]:
    """step -> the last metrics.jsonl record of `kind` at that step."""
    out = {}
    path = os.path.join(model_dir, "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path):
            try:
                r = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if r.get("kind") == kind:
                out[r["step"]] = r
    return out


def records_of(model_dir: str) -> list[dict]:
    path = os.path.join(model_dir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def host_pids(model_dir: str) -> list[int]:
    """Processes of this run's hosts (main.py with this --model_dir and a DTensor client id)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            env = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if f"--model_dir={model_dir}".encode() in cmdline and b"DTENSOR_CLIENT_ID=" in env and b"main.py" in cmdline:
            pids.append(int(pid))
    return pids


def rel_dev(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def checkpoint_dev(a: str, b: str) -> float:
    import numpy as np
    import tensorflow as tf

    keys = [k for k, _ in tf.train.list_variables(b) if k.endswith("VARIABLE_VALUE") and not k.startswith("save_counter")]
    if sorted(keys) != sorted(k for k, _ in tf.train.list_variables(a) if k.endswith("VARIABLE_VALUE")
                              and not k.startswith("save_counter")):
        return float("inf")
    return max(float(np.max(np.abs(tf.train.load_variable(a, k).astype(np.float64) - tf.train.load_variable(b, k))))
               for k in keys)


FAULT_KINDS = ("exception", "kill", "hang", "nonfinite", "ckpt_fail", "ckpt_truncate", "slow")
SLOW_S = 0.3  # a slow host's sleep before every call (until the next restart)


def fault_spec(args, rng) -> str:
    """--faults=N: N faults of the kinds in turn at seeded random steps (the checkpoint kinds at
    checkpoint steps) and hosts, no two at one (kind, step, host): a TFPOD_FAULT value."""
    chosen = set()
    while len(chosen) < args.faults:
        kind = FAULT_KINDS[len(chosen) % len(FAULT_KINDS)]
        every = args.checkpoint_every if kind.startswith("ckpt_") else 1
        step = every * rng.randint(max(1, 2 // every), (args.steps - 1) // every)
        chosen.add((kind, step, rng.randrange(args.hosts)))
    return ",".join(f"{k}@{s}:{h}" + (f"={SLOW_S}" if k == "slow" else "") for k, s, h in sorted(chosen, key=lambda f: f[1]))


def soak_faults(args, run_dir: str, eval_file: str, rng, log) -> dict:
    """One launch under tfpod.launch --max_restarts with TFPOD_FAULT: what it survived and the cost."""
    spec = fault_spec(args, rng)
    main = main_command(args, run_dir, eval_file)
    main = main[main.index("--") + 1:] if args.hosts > 1 else [a for a in main if a != "--cpu_devices=8"]
    main += ["--gin_param=train.hang_min_s=5", "--gin_param=train.hang_factor=10"]
    cmd = [sys.executable, "-m", "tfpod.launch", f"--num_hosts={args.hosts}", f"--devices_per_host={8 // args.hosts}",
           f"--max_restarts={args.faults + 5}", "--restart_backoff_s=0.5", "--restart_reset_s=5", "--"] + main
    log(f"TFPOD_FAULT={spec}")
    with open(os.path.join(args.out, "faults.log"), "w+") as output:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, TFPOD_FAULT=spec))
        output.seek(0)
        out = output.read()
    fired = sorted(set(re.findall(r"fault injected: (\S+) on host", out)))
    ending = [f for f in fired if not f.startswith("slow@")]  # a slow host ends no launch
    history = json.load(open(os.path.join(run_dir, "goodput.json")))["launches"]
    # from a failed launch's last record to its successor's first steady step
    recover = [b["start"] + b["startup_s"] + b["compile_s"] - a["last"] for a, b in zip(history, history[1:])]
    trained = [r for r in records_of(run_dir) if r.get("kind") == "train"]
    return {"faults": spec, "faults_fired": len(fired), "kinds": sorted({f.split("@")[0] for f in fired}),
            "restarts": out.count("starting every host again"), "launcher_exit": proc.returncode,
            "steps_trained_again_per_fault": round((len(trained) - len({r["step"] for r in trained}))
                                                   / max(1, len(ending)), 2),
            "memory_restores": out.count("resumed from the in-memory snapshot") // args.hosts,
            "recovery_s_per_fault": round(sum(recover) / max(1, len(recover)), 1),
            "failure": None if proc.returncode == 0 else f"the launcher exited {proc.returncode}: "
                                                          f"{out.strip().splitlines()[-1:]}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600, help="how long to keep killing and relaunching")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint_every", type=int, default=4)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--hosts", type=int, default=1, choices=(1, 2, 4, 8))
    parser.add_argument("--min_gap", type=float, default=3, help="least seconds between a launch and its kill")
    parser.add_argument("--max_gap", type=float, default=20, help="most seconds between a launch and its kill")
    parser.add_argument("--sigterm_fraction", type=float, default=0.25, help="share of kills that are SIGTERM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=0,
                        help="instead of kills: this many injected faults (tfpod.faults; kinds in turn: "
                             + ", ".join(FAULT_KINDS) + ") in one run under tfpod.launch --max_restarts")
    parser.add_argument("--memory_every", type=int, default=0,
                        help="in-memory snapshots every this many steps (train.memory_checkpoint_every; 0: off)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "soak"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    ref_dir, run_dir = os.path.join(args.out, "reference"), os.path.join(args.out, "killed")
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    log = lambda *a: print("soak:", *a, file=sys.stderr, flush=True)

    eval_file = first_eval_file()
    t0 = time.time()
    ref = subprocess.run(main_command(args, ref_dir, eval_file), cwd=ROOT, capture_output=True, text=True)
    if ref.returncode:
        print(ref.stderr[-3000:], file=sys.stderr)
        print(json.dumps({"error": "the reference run failed"}))
        return 1
    log(f"reference: {args.steps} steps in {time.time() - t0:.0f}s")

    t_start, kills, sigterms, launches, failure = time.time(), 0, 0, 0, None
    injected = soak_faults(args, run_dir, eval_file, rng, log) if args.faults else None
    if injected:
        failure, launches = injected.pop("failure"), injected["restarts"] + 1
    while not injected:
        launches += 1
        output = open(os.path.join(args.out, f"launch-{launches}.log"), "w+")  # a file: a pipe could fill and block
        proc = subprocess.Popen(main_command(args, run_dir, eval_file), cwd=ROOT, stdout=output,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        read = lambda: (proc.wait(), output.seek(0), output.read())[2]
        soaking = time.time() - t_start < args.seconds
        deadline = time.time() + rng.uniform(args.min_gap, args.max_gap)
        while proc.poll() is None and (not soaking or time.time() < deadline):
            time.sleep(0.1)
        if proc.poll() is None:  # kill it
            step = max(records(run_dir, "train"), default=0)
            if rng.random() < args.sigterm_fraction:
                sigterms += 1
                proc.send_signal(signal.SIGTERM)  # (the launcher passes it to every host)
                out = read()
                log(f"launch {launches}: SIGTERM near step {step}: exit {proc.returncode}")
                if proc.returncode != 0:
                    failure = f"a SIGTERM'd launch exited {proc.returncode}: {out.strip().splitlines()[-1:]}"
                    break
                if out.count("preempted: ") < args.hosts:  # every host saved and stopped (none trained on)
                    failure = f"a SIGTERM'd launch did not stop on every host: {out.strip().splitlines()[-1:]}"
                    break
            else:
                kills += 1
                victims = host_pids(run_dir) if args.hosts > 1 else [proc.pid]
                os.kill(rng.choice(victims) if victims else proc.pid, signal.SIGKILL)
                proc.communicate()
                log(f"launch {launches}: SIGKILL near step {step}")
            continue
        out = read()
        if proc.returncode != 0:
            failure = f"launch {launches} exited {proc.returncode}: {out.strip().splitlines()[-1:]}"
        break
    seconds = time.time() - t_start

    want_train, got_train = records(ref_dir, "train"), records(run_dir, "train")
    want_eval, got_eval = records(ref_dir, "eval"), records(run_dir, "eval")
    missing = sorted(set(want_train) - set(got_train)) + sorted(set(want_eval) - set(got_eval))
    loss_dev = max((rel_dev(got_train[s]["loss"], r["loss"]) for s, r in want_train.items() if s in got_train),
                   default=float("inf"))
    metrics = [k for k, v in next(iter(want_eval.values()), {}).items()
               if isinstance(v, float) and k not in ("time", "train_seconds")]
    eval_dev = max((rel_dev(got_eval[s][k], r[k]) for s, r in want_eval.items() if s in got_eval for k in metrics),
                   default=float("inf"))
    final = f"checkpoints/ckpt-{args.steps}"
    weight_dev = (checkpoint_dev(os.path.join(run_dir, final), os.path.join(ref_dir, final))
                  if os.path.exists(os.path.join(run_dir, final + ".index")) else float("inf"))
    exact = not failure and not missing and max(loss_dev, eval_dev) <= 1e-6 and weight_dev <= 1e-6
    result = {"kills": kills, "sigterms": sigterms, "launches": launches, "steps": args.steps, "hosts": args.hosts,
              "evals": len(want_eval), "max_loss_rel_dev": loss_dev, "max_eval_rel_dev": eval_dev,
              "max_weight_abs_dev": weight_dev, "missing_steps": missing, "exact": exact,
              "seconds": round(seconds, 1), "failure": failure, **(injected or {})}
    good = [r for r in records_of(run_dir) if r.get("kind") == "goodput"]
    if good:  # the run's own account over all its launches (tfpod.goodput), against the uninterrupted one's
        result["goodput"] = {k: good[-1][k] for k in ("goodput", "badput", "launches", "wall_s")}
        ref = [r for r in records_of(ref_dir) if r.get("kind") == "goodput"]
        result["reference_goodput"] = ref[-1]["goodput"] if ref else None
    print(json.dumps(result))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
