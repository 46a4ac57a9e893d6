"""How long `--mode=plan` takes to build and plan a large model on this CPU.

GPT-3 175B (96 blocks, the shape of tests/test_plan.py's 175B test), planned on 1024
A100-80GB as data:128,model:8 with the 2d preset and sequence parallelism:

  build_s        the Planner's lazy build (tfpod.plan.lazy: each kind of block's forward
                 pass run once, the others replayed)
  plan_s         one plan on that mesh
  full_build_s   the same lazy build calling every block (lazy.recorded_build(replay=False)),
                 what the build took before the replay; its variables must be the same
  max_rss_mib    the process's peak resident memory (nothing of 175B x 4 bytes is allocated)

    python bench/plan_time.py [--layers=96]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    args = parser.parse_args()

    import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
    import tf_keras

    from plan_published import gpt_configs
    from tfpod import partitioning
    from tfpod.models import gpt
    from tfpod.plan import devices, lazy
    from tfpod.plan.planner import Choice, Planner
    from tfpod.precision import precision_policy

    configs = gpt_configs(args.layers, 12288, 96, 49152, 51200, 2048, 1536)
    model = configs.model
    t = time.perf_counter()
    planner = Planner(configs, devices.get("a100-80g"), 1024)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    plan = planner.plan(Choice("data:128,model:8", "2d", sequence_parallel=True))
    plan_s = time.perf_counter() - t

    tf_keras.backend.clear_session()
    t = time.perf_counter()
    with precision_policy("mixed_bfloat16"), lazy.recorded_build(replay=False):
        _, specs = partitioning.lazy_model(lambda: gpt.TASK.build(model), gpt.TASK.input_signature(model))
    full_build_s = time.perf_counter() - t
    if [(s.shape, s.dtype) for s in specs] != [(s.shape, s.dtype) for s in planner.specs]:
        raise SystemExit("plan_time: the replayed build's variables differ from the full build's")

    result = {"model": f"gpt {args.layers} blocks of GPT-3 175B's width", "parameters": plan["parameters"],
              "build_s": round(build_s, 2), "plan_s": round(plan_s, 2), "full_build_s": round(full_build_s, 2),
              "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
