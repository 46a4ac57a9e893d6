"""Per-device memory and step time of each sharding preset, gpt_small on 8 logical CPU devices.

    python bench/presets.py [--presets=data,tensor,2d,weight_update] [--mesh=PRESET=SPEC ...]
                            [--steps=2] [--global_batch=8] [--seq_len=128] [--num_layers=12]
                            [--precision=float32] [--max_rss_gib=0] [--verbose]
                            [--lora_rank=0] [--lora_targets=attention] [--plan]

With --lora_rank the model trains LoRA adapters on a frozen base (tfpod.lora): the
frozen weights have no gradient and no optimizer slots; with --plan each preset's
measured bytes stand beside the planner's (`main.py --mode=plan` for the same run).

Each preset runs in its own process: a fresh TensorFlow runtime with 8 logical CPU
devices, so the process's peak RSS (`ru_maxrss`) belongs to that preset alone. The
process builds gpt_small's Trainer (tfpod.trainer.Trainer with the preset's
`Placement`) and reports, from the variables' layouts
(`partitioning.bytes_per_device`):

  params         model weights one device holds
  slots          optimizer slots one device holds (AdamW `m`, `v`: `<weight>/<slot>`)
  copies         weight_update's sharded working copies (`<weight>/update_shard`)
  total          their sum, per device and over all devices of the mesh

then trains `1 + steps` steps on synthetic batches, one step per call of the compiled
loop: the first call compiles and is not timed; the step time is the mean of the
following steps as metrics.jsonl records them (one record per step). The final
checkpoint Trainer.train writes is skipped (replaced by a no-op): it is not measured
and would write 1.5 GB per preset. Peak RSS is the whole process: TF runtime,
weights, optimizer state, gradients, activations and compile-time buffers of all 8
logical devices, which all live in host memory here.

Default meshes: data on data:8, tensor on data:2,model:4 (12 heads, mlp 3072 and
vocab 50304 all divide by 4), 2d on data:4,model:2, weight_update on data:8. Every
preset trains the same model from the same seed on the same batches, so each
preset's per-step losses are compared with `data`'s (`loss_matches_data`: relative
difference below 1e-3 at every step; when `data` did not train, `loss_reference`
names the preset compared with instead and `loss_matches_data` is null). Dropout is
off (gin/gpt_small.gin has 0.1) so that the comparison is exact up to reduction order.

A preset process whose RSS passes --max_rss_gib (default: 80% of the memory
available when it starts) is stopped, and the preset reports its memory figures,
a lower bound on its peak RSS and an error. On 8 logical CPU devices every device's
copy lives in host memory, and after three steps the process holds 3-9x the
weight-and-optimizer total (gradients, all-reduce buffers, activations, compiled
programs): gpt_small's `data` (11.1 GiB of weights and slots over 8 devices) needs
more than a 23 GiB machine has, and `weight_update` (5.1 GiB, plus 3.7 GiB of
replicated gradients) peaked at 18 GiB there, so it runs only when that much is
free; --num_layers=2 runs all four presets there.

Shape: gpt_small (gin/model/gpt_small.gin: 12 layers, 768 wide, 12 heads, mlp 3072,
vocab 50304) except seq_len, which defaults to 128 instead of 1024 so that the four
presets finish in 10-12 minutes on a 2-core CPU (gpt_small at 1024 runs about 200
tokens/s on one device); --seq_len=1024 gives the full shape. The weight and
optimizer figures depend on seq_len only through the position table (seq_len x 768
floats: 0.375 MiB at 128, 3 MiB at 1024, plus its two Adam slots); everything else
is independent of seq_len and of the batch. Peak RSS and step time do depend on both.

The last line is one JSON object:
  {"model": "gpt_small", "devices": 8, "seq_len", "global_batch", "presets": {name: {...}}}.
A preset that fails has "error" (one line) and the figures it got (the memory figures
when training failed); the script exits 1 after printing the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PRESET_ORDER = ("data", "tensor", "2d", "weight_update")
DEFAULT_MESH = {"data": "data:8", "tensor": "data:2,model:4", "2d": "data:4,model:2", "weight_update": "data:8"}
GPT_SMALL = dict(vocab_size=50304, num_layers=12, embed_dim=768, num_heads=12, mlp_dim=3072)
LOSS_RTOL = 1e-3
# Kinds of weight for the per-device breakdown, by variable name (first match).
KINDS = (
    ("token_embedding", r".*/token_embedding/.*"),
    ("position_embedding", r".*/position_embedding/.*"),
    ("attention", r".*/self_attention/.*"),
    ("mlp", r".*/(intermediate|output)/(kernel|bias)"),
    ("norms", r".*(layer_norm|final_norm)/.*"),
)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _kind(name: str) -> str:
    for kind, pattern in KINDS:
        if re.fullmatch(pattern, name):
            return kind
    return "other"


def measure(args) -> dict:
    """One preset in this process: memory from the layouts, peak RSS, steady-state step time."""
    import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
    from tfpod import runtime

    runtime.initialize(cpu_devices=args.cpu_devices, device_type="CPU")
    from tfpod import api, controller, lora, mesh as meshlib, optimizers, partitioning
    from tfpod.models import gpt

    rss_runtime = _peak_rss_bytes()
    mesh = meshlib.make_mesh(args.mesh)
    devices = mesh.size
    placement = partitioning.Placement.from_config(
        partitioning.ShardingConfig(preset=args.preset, sequence_parallel=False), gpt.TASK.default_preset, mesh,
        check=False)
    model_cfg = gpt.GPTConfig(**{**GPT_SMALL, "num_layers": args.num_layers}, seq_len=args.seq_len)
    train_cfg = controller.TrainConfig(
        steps=1 + args.steps, global_batch_size=args.global_batch, seed=0, steps_per_loop=1, log_every=1,
        checkpoint_every=10**9, synthetic_data=True, precision=args.precision,
    )
    # gin/gpt_small.gin's optimizer without warmup, so that every step moves the weights.
    opt_cfg = optimizers.OptimizerConfig(learning_rate=6e-4, warmup_steps=0, beta_2=0.95)

    with tempfile.TemporaryDirectory() as model_dir:
        task = lora.adapt(gpt.TASK, lora.LoraConfig(rank=args.lora_rank, targets=tuple(args.lora_targets.split(","))))
        run = api.controller(task, model_cfg, train_cfg, opt_cfg, placement, model_dir)
        t = run.trainer
        params, by_kind, grads = 0, {}, 0
        params_global = 0
        for s in t.specs:
            b = partitioning.bytes_per_device(s.shape, s.dtype, t.layouts[s.name])
            params += b
            grads += b if s.trainable else 0  # a gradient has its weight's layout (frozen weights: none)
            by_kind[_kind(s.name)] = by_kind.get(_kind(s.name), 0) + b
            params_global += int(_prod(s.shape)) * s.dtype.size
        slots = copies = 0
        for s in t.state_specs:
            b = partitioning.bytes_per_device(s.shape, s.dtype, t.state_layouts[s.name])
            if s.name.endswith("/update_shard"):
                copies += b
            else:
                slots += b
        rss_built = _peak_rss_bytes()
        memory = {
            "mesh": ",".join(f"{n}:{mesh.dim_size(n)}" for n in mesh.dim_names),
            "update_axis": placement.update_axis,
            "gather_axis": placement.gather_axis,
            "param_bytes_per_device": params,
            "param_bytes_per_device_by_kind": by_kind,
            "gradient_bytes_per_device": grads,
            "slot_bytes_per_device": slots,
            "working_copy_bytes_per_device": copies,
            "total_bytes_per_device": params + slots + copies,
            "param_bytes_all_devices": params * devices,
            "slot_bytes_all_devices": slots * devices,
            "working_copy_bytes_all_devices": copies * devices,
            "total_bytes_all_devices": (params + slots + copies) * devices,
            "param_bytes_unsharded": params_global,
            "rss_after_runtime_bytes": rss_runtime,
            "rss_after_build_bytes": rss_built,
            "devices": devices,
        }
        print(json.dumps(memory), flush=True)  # the parent keeps these if training fails
        run.checkpoints.save = lambda **kwargs: None  # the end-of-run checkpoint is not measured
        run.checkpoints.check_finite = lambda: None
        loop, rss_after_step = t.train_loop, []

        def loop_and_rss(*a, **kw):  # the process's RSS after each call: compile peak vs. steady state
            result = loop(*a, **kw)
            rss_after_step.append(_rss_bytes(os.getpid()))
            return result

        t.train_loop = loop_and_rss
        t0, t0_wall = time.perf_counter(), time.time()
        out = run.train()
        train_wall = time.perf_counter() - t0
        records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    records = [r for r in records if r["kind"] == "train"]
    timed = records[1:]  # the first record is the compiling call
    tokens_per_step = args.global_batch * args.seq_len
    step_times = [tokens_per_step / r["tokens_per_sec"] for r in timed]
    step_time = sum(step_times) / len(step_times)
    return {
        **memory,
        "peak_rss_bytes": _peak_rss_bytes(),
        "rss_after_step_bytes": rss_after_step,
        "first_call_s": records[0]["time"] - t0_wall,
        "step_time_s": step_time,
        "step_times_s": step_times,
        "tokens_per_sec": tokens_per_step / step_time,
        "mfu": sum(r["mfu"] for r in timed) / len(timed),
        "train_wall_s": train_wall,
        "losses": out["losses"],
        "final_loss": out["losses"][-1],
    }


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _available_bytes() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_bytes(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_preset(preset: str, mesh: str, args) -> dict:
    """Runs `measure` for one preset in a fresh process; its JSON, or {"error": ...}.

    The process is stopped when its RSS passes the cap (--max_rss_gib; default 80% of the
    memory available when it starts), before the kernel's OOM killer would pick a process
    on a shared machine. The memory figures from the layouts come before training, so a
    preset stopped in training still reports them.
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--preset={preset}", f"--worker_mesh={mesh}",
           f"--steps={args.steps}", f"--global_batch={args.global_batch}", f"--seq_len={args.seq_len}",
           f"--num_layers={args.num_layers}", f"--precision={args.precision}", f"--cpu_devices={args.cpu_devices}",
           f"--lora_rank={args.lora_rank}", f"--lora_targets={args.lora_targets}"]
    available = _available_bytes()
    cap = args.max_rss_gib * 2**30 if args.max_rss_gib else (0.8 * available if available else None)
    print(f"[presets] {preset} on {mesh} (RSS cap {cap / 2**30:.1f} GiB) ..." if cap else
          f"[presets] {preset} on {mesh} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=out, stderr=None if args.verbose else err)
        stopped, peak = None, 0
        while proc.poll() is None:
            rss = _rss_bytes(proc.pid)
            peak = max(peak, rss)
            if cap and rss > cap:
                stopped = f"stopped at {rss / 2**30:.1f} GiB RSS, over the {cap / 2**30:.1f} GiB cap (--max_rss_gib)"
            elif time.perf_counter() - t > args.timeout:
                stopped = f"timed out after {args.timeout}s (--timeout)"
            if stopped:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        lines = [line for line in out.read().strip().splitlines() if line.startswith("{")]
        err_lines = err.read().strip().splitlines()
    wall = time.perf_counter() - t
    result = json.loads(lines[-1]) if lines else {"mesh": mesh}
    result["process_wall_s"] = wall
    if stopped or proc.returncode or "step_time_s" not in result:
        status = f"exit status {proc.returncode}" + (" (killed: out of memory?)" if proc.returncode == -9 else "")
        result["error"] = stopped or (err_lines[-1] if err_lines else status)
        result["peak_rss_bytes"] = max(result.get("peak_rss_bytes", 0), peak)
        print(f"[presets] {preset}: failed: {result['error']}", file=sys.stderr, flush=True)
        return result
    print(f"[presets] {preset}: {result['step_time_s']:.2f} s/step, peak RSS "
          f"{result['peak_rss_bytes'] / 2**30:.2f} GiB, {wall:.0f} s", file=sys.stderr, flush=True)
    return result


def plan_bytes(preset: str, mesh: str, args) -> dict:
    """The planner's per-device bytes (`main.py --mode=plan`, plan.json) for the same run."""
    params = {"gpt.seq_len": args.seq_len, "gpt.num_layers": args.num_layers, "gpt.dropout": 0.0,
              "train.global_batch_size": args.global_batch, "train.precision": f"'{args.precision}'",
              "sharding.preset": f"'{preset}'", "lora.rank": args.lora_rank,
              "lora.targets": repr(tuple(args.lora_targets.split(",")))}
    with tempfile.TemporaryDirectory() as model_dir:
        cmd = [sys.executable, "main.py", "--gin_file=gin/gpt_small.gin", "--mode=plan", f"--mesh={mesh}",
               f"--model_dir={model_dir}", f"--cpu_devices={args.cpu_devices}",
               *[f"--gin_param={k}={v}" for k, v in params.items()]]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            return {"error": (proc.stderr.strip().splitlines() or ["plan failed"])[-1]}
        with open(os.path.join(model_dir, "plan.json")) as f:
            return json.load(f)["per_device_bytes"]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def table(results: dict, args, ref_name: str | None) -> str:
    """A markdown table of the figures (MiB = 2^20 bytes)."""
    head = ("preset", "mesh", "params/device (MiB)", "gradients/device", "optimizer slots/device",
            "working copies/device", "total/device", "total, all devices", "planned weights / gradients / optimizer",
            "peak RSS (GiB)", "step time (s)", "tokens/s", "final loss", f"loss = {ref_name or 'data'}'s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    failures = []
    for name, r in results.items():
        has_memory = "param_bytes_per_device" in r
        mem = [_mib(r[k]) if has_memory else "-" for k in (
            "param_bytes_per_device", "gradient_bytes_per_device", "slot_bytes_per_device",
            "working_copy_bytes_per_device", "total_bytes_per_device", "total_bytes_all_devices")]
        plan = r.get("plan_bytes_per_device", {})
        mem.append(" / ".join(_mib(plan[k]) for k in ("weights", "gradients", "optimizer")) if "weights" in plan
                   else plan.get("error", "-"))
        rss = f"{r['peak_rss_bytes'] / 2**30:.2f}" if r.get("peak_rss_bytes") else "-"
        if "error" in r and r.get("peak_rss_bytes"):
            rss = "> " + rss  # stopped before its peak
        if "error" in r:
            failures.append(f"`{name}` failed: {r['error']}")
            timing = [f"failed ({len(failures)})", "-", "-", "-"]
        else:
            timing = [f"{r['step_time_s']:.2f}", f"{r['tokens_per_sec']:,.0f}", f"{r['final_loss']:.4f}",
                      {True: "yes", False: "NO", None: "-"}[r.get("loss_matches_reference")]]
        lines.append("| " + " | ".join([f"`{name}`", r["mesh"], *mem, rss, *timing]) + " |")
    lines += [""] + [f"({i}) {f.replace('|', '/')}" for i, f in enumerate(failures, 1)] if failures else []
    note = (f"gpt_small ({args.num_layers} layers, 768 wide, 12 heads, mlp 3072, vocab 50304), seq_len "
            f"{args.seq_len}" + (" (the full shape has 1024: the position table shrinks to "
                                 f"{args.seq_len} x 768)" if args.seq_len != 1024 else "")
            + (f"; LoRA rank {args.lora_rank} on {args.lora_targets}" if args.lora_rank else "")
            + f", global batch {args.global_batch}, {args.precision}, AdamW; {args.cpu_devices} logical CPU devices "
            f"on {os.cpu_count()} cores; step time: mean of {args.steps} steps after the compiling one. "
            "Memory in MiB from the layouts; peak RSS is the whole process (all devices share host memory).")
    return note + "\n\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--worker_mesh", help=argparse.SUPPRESS)
    parser.add_argument("--presets", default=",".join(PRESET_ORDER), help="comma-separated presets to run")
    parser.add_argument("--mesh", action="append", default=[], metavar="PRESET=SPEC",
                        help="mesh of one preset, e.g. --mesh=tensor=data:4,model:2 (repeatable)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the compiling one")
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128, help="gpt_small has 1024")
    parser.add_argument("--num_layers", type=int, default=12)
    parser.add_argument("--precision", default="float32", choices=("float32", "mixed_bfloat16"))
    parser.add_argument("--cpu_devices", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per preset process")
    parser.add_argument("--max_rss_gib", type=float, default=0,
                        help="stop a preset process whose RSS passes this many GiB "
                             "(0: 80%% of the memory available at its start)")
    parser.add_argument("--verbose", action="store_true", help="show each preset process's log")
    parser.add_argument("--lora_rank", type=int, default=0, help="LoRA adapters of this rank (tfpod.lora; 0: none)")
    parser.add_argument("--lora_targets", default="attention", help="lora.targets, comma-separated")
    parser.add_argument("--plan", action="store_true", help="the planner's per-device bytes beside each preset's")
    args = parser.parse_args()

    if args.worker:
        args.mesh = args.worker_mesh
        try:
            print(json.dumps(measure(args)))
        except Exception as e:  # noqa: BLE001  one line for the parent, traceback with --verbose
            from tfpod import UserError

            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"error: {args.preset} on {args.mesh}: {'' if isinstance(e, UserError) else type(e).__name__ + ': '}"
                  f"{first}", file=sys.stderr)
            sys.exit(1)
        return

    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in presets if p not in DEFAULT_MESH]
    if unknown:
        raise SystemExit(f"error: --presets: {', '.join(unknown)} unknown; use some of {', '.join(PRESET_ORDER)}")
    meshes = dict(DEFAULT_MESH)
    for item in args.mesh:
        name, sep, spec = item.partition("=")
        if not sep or name not in DEFAULT_MESH or not spec:
            raise SystemExit(f"error: --mesh={item!r}: use PRESET=SPEC with PRESET one of {', '.join(PRESET_ORDER)}, "
                             "e.g. --mesh=tensor=data:4,model:2")
        meshes[name] = spec
    if args.steps < 1 or args.global_batch < 1 or args.seq_len < 1 or args.num_layers < 1:
        raise SystemExit("error: --steps, --global_batch, --seq_len and --num_layers must be at least 1")

    results = {p: run_preset(p, meshes[p], args) for p in presets}
    if args.plan:
        for p in presets:
            results[p]["plan_bytes_per_device"] = plan_bytes(p, meshes[p], args)
    # Every preset trains the same model from the same seed on the same batches: the
    # per-step losses agree up to reduction order. The reference is `data` (the next
    # preset that trained when `data` did not).
    ref_name = next((n for n in ["data", *results] if "losses" in results.get(n, {})), None)
    for name, r in results.items():
        if "losses" not in r:
            continue
        ref = results[ref_name]["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        r["loss_rel_diff_vs_reference"] = rel
        r["loss_matches_reference"] = bool(rel < LOSS_RTOL and len(r["losses"]) == len(ref))
        r["loss_matches_data"] = r["loss_matches_reference"] if ref_name == "data" else None

    print(table(results, args, ref_name))
    print(json.dumps({
        "model": "gpt_small", "devices": args.cpu_devices, "seq_len": args.seq_len, "global_batch": args.global_batch,
        "num_layers": args.num_layers, "precision": args.precision, "timed_steps": args.steps,
        "lora_rank": args.lora_rank, "lora_targets": args.lora_targets if args.lora_rank else None,
        "cores": os.cpu_count(), "loss_reference": ref_name, "presets": results,
    }))
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
