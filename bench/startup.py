"""What runtime.initialize's two start-up settings save in one process on this CPU.

  settle_garbage_collector       the objects alive after start-up frozen for Python's
                                 collector, young collections every 50,000 allocations
  share_variable_handle_programs eager variable handles without a per-variable debug
                                 name, so DTensor compiles one VarHandleOp program per
                                 shape and layout instead of one per variable

Each variant runs in a fresh process (`--variant=tuned`: as tfpod runs; `--variant=plain`:
both settings skipped): 60 variables with distinct names created on `data:4,model:2`,
then gin/lm_tiny.gin (one block, synthetic data) trained 2 steps in process on that mesh.

  variable_ms   milliseconds per variable created (the 60 above)
  run_s         the 2-step run: building the model and optimizer state, compiling, 2 steps
  gc_s          seconds Python's collector ran during the run

    python bench/startup.py [--repeats=3]

The last line is JSON: the median of each figure per variant, and the plain / tuned ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def one(variant: str) -> dict:
    """One measurement in this process."""
    import gc
    import time

    import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
    from tfpod import compat, runtime

    if variant == "plain":
        runtime.settle_garbage_collector = lambda: None
        compat.share_variable_handle_programs = lambda: None
    runtime.initialize(cpu_devices=8, device_type="CPU")
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    from tfpod.api import run
    from tfpod.mesh import make_mesh

    mesh = make_mesh("data:4,model:2")
    init = dtensor.call_with_layout(tf.zeros, dtensor.Layout.replicated(mesh, 2), [16, 16])
    t = time.perf_counter()
    for i in range(60):
        dtensor.DVariable(init, name=f"bench_{i}")
    variable_ms = (time.perf_counter() - t) / 60 * 1000

    spent = {"s": 0.0}

    def timer(phase, info):
        if phase == "start":
            spent["t0"] = time.perf_counter()
        else:
            spent["s"] += time.perf_counter() - spent["t0"]

    gc.callbacks.append(timer)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        run(["gin/lm_tiny.gin"], ["gpt.num_layers=1", "train.steps=2", "train.steps_per_loop=2", "train.log_every=2",
                                  "train.synthetic_data=True"], d, mesh=mesh)
    run_s = time.perf_counter() - t
    gc.callbacks.remove(timer)
    return {"variable_ms": round(variable_ms, 2), "run_s": round(run_s, 2), "gc_s": round(spent["s"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=["tuned", "plain"], help="(internal) measure one variant here")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one(args.variant)))
        return
    env = {**os.environ, "TFPOD_GRAPH_OPTIMIZATIONS": "0"}  # as the tests compile
    results = {"tuned": [], "plain": []}
    for _ in range(args.repeats):  # in turn, so a slow spell of the machine hits both
        for variant in results:
            out = subprocess.run([sys.executable, __file__, f"--variant={variant}"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, check=True)
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(variant, results[variant][-1], flush=True)
    median = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in results.items()}
    ratio = {k: round(median["plain"][k] / max(median["tuned"][k], 1e-9), 2) for k in median["tuned"]}
    print(json.dumps({"median": median, "plain_over_tuned": ratio, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
