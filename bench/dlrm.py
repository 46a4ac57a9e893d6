"""DLRM-style training with sharded embedding tables: tfpod against plain tf_keras, and table memory.

    python bench/dlrm.py [--rows=100000,1000000,4000000] [--meshes=data:1,data:4+model:2,data:8]
        [--runs=keras_fit,tfpod] [--table_axis=data] [--tables=whole] [--batch=512] [--warmup=8]
        [--steps=8] [--repeats=1] [--exact_auc_examples=0]

The model is issue 66's: 13 dense features through Dense(32); three one-hot categorical
features with tables of `rows`, rows / 10 and 1,000 rows x 32; two DCN-v2 cross layers
(tfpod's low-rank form at full rank 128: x0 * (W (V x) + b) + x); Dense(64); the logit;
binary cross-entropy; Adagrad 0.05 (tf_keras's); batch 512. Every run is the same class
(models/dlrm.py DLRM) and the same synthetic clicks, each measurement in its own process:

  keras_fit   plain tf_keras `compile` + `fit` of the model on one device (no tfpod
              runtime, no mesh): the tables are looked up by tf.gather and their
              gradients are IndexedSlices, which tf_keras's Adagrad applies sparsely
  tfpod       tfpod's Trainer on `--meshes` (one process per mesh and row count), fed
              keras_fit's pregenerated batches (generating clicks costs ~9 ms a batch,
              which neither run's time includes):
              tables laid out by the dlrm task's rules (rows over `model`; on data:8
              replicated, or over `data` with `--table_axis=data`; with `--tables=whole` each
              table whole on the devices of one position of that axis), looked up and updated
              on the devices that hold their shards (tfpod.embedding)

Each runs `--warmup` steps (compiling) and then `--steps` timed steps (tfpod: one loop
call of `--steps` steps, as train.steps_per_loop); the step time is the timed steps' wall
time over their count (everything the loop does between steps included). Each process
reports its peak RSS, and tfpod's runs the most bytes any one device holds of the
tables and their Adagrad accumulators from the run's own layouts.

`--exact_auc_examples=N` also times tfpod.auc.exact_auc on N synthetic examples on one
device (the reference's eval set is 89,137,319).

The last line is one JSON object: {"runs": {"<run>@<mesh>@<rows>": {...}}, "speed_vs_keras":
{"<mesh>@<rows>": ...}, "flat": {"<run>@<mesh>": largest / smallest step time over rows}, settings}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workers import run_worker  # noqa: E402  (bench/workers.py)


def model_config(rows: int):
    from tfpod.models import dlrm

    return dlrm.DLRMConfig(table_sizes=(rows, max(rows // 10, 8), 1000), multi_hot_sizes=(1, 1, 1), embedding_dim=32,
                           dense_features=13, bottom_mlp=(32,), top_mlp=(64, 1), cross_layers=2, cross_rank=128,
                           row_multiple=8)


def batches(cfg, batch: int, count: int) -> list:
    import numpy as np

    from tfpod.input import clicks

    rng = np.random.default_rng(0)
    return [clicks.synthetic_batch(cfg, batch, rng) for _ in range(count)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_keras_fit(args) -> dict:
    import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
    import numpy as np
    import tensorflow as tf
    import tf_keras

    from tfpod.models import dlrm

    cfg = model_config(args.rows)
    data = batches(cfg, args.batch, args.warmup + args.steps)
    features = {k: np.concatenate([b[k] for b in data]) for k in data[0] if k not in ("labels", "weights")}
    labels = np.concatenate([b["labels"] for b in data])
    tf_keras.utils.set_random_seed(0)
    model = dlrm.DLRM(cfg)
    model.compile(optimizer=tf_keras.optimizers.legacy.Adagrad(0.05),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    ends = []

    class Times(tf_keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(args.batch)
    model.fit(dataset, epochs=1, callbacks=[Times()], verbose=0)
    step = (ends[-1] - ends[args.warmup - 1]) / args.steps
    return {"step_time_s": step, "peak_rss_mb": peak_rss_mb()}


def run_tfpod(args) -> dict:
    from tfpod import runtime

    mesh_spec = args.mesh.replace("+", ",")
    devices = 1
    for axis in mesh_spec.split(","):
        devices *= int(axis.split(":")[1])
    runtime.initialize(cpu_devices=devices, device_type="CPU")
    from tfpod import api, controller, mesh as meshlib, optimizers, partitioning
    from tfpod.models import dlrm
    from tfpod.partitioning import bytes_by_device

    cfg = model_config(args.rows)
    mesh = meshlib.make_mesh(mesh_spec)
    rules = {"vocab": args.table_axis} if args.table_axis else None
    placement = partitioning.Placement.from_config(
        partitioning.ShardingConfig(preset="tensor", rules=rules, tables=args.tables), "tensor", mesh, check=False)
    train_cfg = controller.TrainConfig(steps=args.warmup + args.steps, global_batch_size=args.batch, seed=0,
                                       steps_per_loop=args.steps, log_every=args.steps, checkpoint_every=10**9,
                                       synthetic_data=True,
                                       peak_flops=1.0)
    opt = optimizers.OptimizerConfig(name="adagrad", learning_rate=0.05, decay="constant", weight_decay=0.0,
                                     clip_norm=0, epsilon=1e-7, initial_accumulator=0.1)
    pool = batches(cfg, args.batch, args.warmup + args.steps)  # keras_fit's batches, made before the clock starts
    drawn = itertools.count()

    class Pregenerated(dlrm.DLRMTask):
        """The dlrm task fed keras_fit's pregenerated batches in turn (train.synthetic_data's feed)."""

        def synthetic_batch(self, config, rows, rng):
            return pool[next(drawn) % len(pool)]

    with tempfile.TemporaryDirectory() as model_dir:
        run = api.controller(Pregenerated(), cfg, train_cfg, opt, placement, model_dir)
        run.checkpoints.save = lambda **kwargs: None
        run.checkpoints.check_finite = lambda: None
        run.train()
        records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    times = {r["step"]: r["time"] for r in records if r["kind"] == "train"}
    step = (times[args.warmup + args.steps] - times[args.warmup]) / args.steps
    trainer = run.trainer
    tables = bytes_by_device([s for s in trainer.specs if "table_" in s.name], trainer.layouts, mesh)
    slots = bytes_by_device([s for s in trainer.state_specs if "table_" in s.name], trainer.state_layouts, mesh)
    table_bytes, slot_bytes = max(tables), max(slots)
    total = sum(s.shape[0] * s.shape[1] * 4 for s in trainer.specs if "table_" in s.name)
    return {"step_time_s": step, "peak_rss_mb": peak_rss_mb(), "table_bytes_per_device": table_bytes,
            "slot_bytes_per_device": slot_bytes, "table_bytes_total": total,
            "table_share_per_device": table_bytes / total, "table_bytes_mean_per_device": sum(tables) / len(tables)}


def run_exact_auc(args) -> dict:
    import tfpod  # noqa: F401
    import numpy as np
    import tensorflow as tf

    from tfpod import auc

    rng = np.random.default_rng(0)
    scores = tf.constant(rng.random(args.exact_auc_examples, np.float32))
    signed = auc.signed_weights(tf.constant(rng.random(args.exact_auc_examples) < 0.03), tf.ones_like(scores))
    fn = tf.function(auc.exact_auc)
    fn(scores[:1000], signed[:1000])
    t = time.perf_counter()
    value = float(fn(scores, signed))
    return {"seconds": time.perf_counter() - t, "examples": args.exact_auc_examples, "auc": value,
            "peak_rss_mb": peak_rss_mb()}


def worker(args) -> dict:
    if args.worker == "keras_fit":
        return run_keras_fit(args)
    if args.worker == "exact_auc":
        return run_exact_auc(args)
    return run_tfpod(args)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="100000,1000000,4000000")
    parser.add_argument("--meshes", default="data:1,data:4+model:2,data:8", help="tfpod's meshes ('+' for ',')")
    parser.add_argument("--runs", default="keras_fit,tfpod")
    parser.add_argument("--table_axis", default="", help="map the tables' rows (logical `vocab`) to this mesh axis")
    parser.add_argument("--tables", default="rows", help="sharding.tables: rows, or whole (table-wise)")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--exact_auc_examples", type=int, default=0)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--worker", default="")
    parser.add_argument("--mesh", default="data:1")
    parser.add_argument("--rows_one", type=int, default=0, dest="rows_one")
    args = parser.parse_args(argv)
    if args.warmup % args.steps:
        parser.error(f"--warmup={args.warmup} must be a multiple of --steps={args.steps} (a loop call's steps)")
    if args.worker:
        args.rows = args.rows_one
        print(json.dumps(worker(args)), flush=True)
        return 0
    common = [f"--batch={args.batch}", f"--warmup={args.warmup}", f"--steps={args.steps}",
              f"--table_axis={args.table_axis}", f"--tables={args.tables}",
              f"--exact_auc_examples={args.exact_auc_examples}"]
    runs, failed = {}, False
    plan = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name in args.runs.split(","):
            meshes = ["data:1"] if name == "keras_fit" else args.meshes.split(",")
            plan += [(name, mesh, rows) for mesh in meshes]
    for _ in range(args.repeats):
        for name, mesh, rows in plan:
            cmd = [sys.executable, os.path.abspath(__file__), f"--worker={name}", f"--mesh={mesh}",
                   f"--rows_one={rows}"] + common
            result = run_worker(cmd, "dlrm", f"{name} {mesh} rows={rows}", ROOT, args.verbose)
            failed |= "error" in result
            key = f"{name}@{mesh}@{rows}"
            old = runs.get(key)
            if old is None or ("step_time_s" in result and result["step_time_s"] < old.get("step_time_s", 1e9)):
                runs[key] = result
    if args.exact_auc_examples:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker=exact_auc"] + common
        runs["exact_auc"] = run_worker(cmd, "dlrm", "exact_auc", ROOT, args.verbose)
    speed, flat = {}, {}
    for key, r in runs.items():
        name, mesh, rows = (key.split("@") + ["", ""])[:3]
        keras = runs.get(f"keras_fit@data:1@{rows}", {})
        if name == "tfpod" and "step_time_s" in r and "step_time_s" in keras:
            speed[f"{mesh}@{rows}"] = keras["step_time_s"] / r["step_time_s"]
    for name, mesh, _ in plan:
        times = [runs[f"{name}@{mesh}@{rows}"].get("step_time_s") for rows in (int(x) for x in args.rows.split(","))]
        if all(times):
            flat[f"{name}@{mesh}"] = max(times) / min(times)
    print(json.dumps({"runs": runs, "speed_vs_keras": speed, "flat": flat, "batch": args.batch,
                      "warmup": args.warmup, "steps": args.steps, "table_axis": args.table_axis,
                      "tables": args.tables}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
