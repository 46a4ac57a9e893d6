"""SSD training throughput: tfpod's trainer against plain tf_keras `model.fit`, images per second.

    python bench/ssd_throughput.py [--gin_file=gin/model/ssd_tiny.gin] [--global_batch=32]
        [--warmup=10] [--steps=30] [--steps_per_loop=10] [--mesh=data:1] [--cpu_devices=1]
        [--runs=tfpod,keras_fit] [--repeats=1]

In one run, each measurement in its own fresh process, one after the other (so none
shares the cores with another):

  tfpod      tfpod's Trainer and Controller (what main.py runs) on a DTensor mesh (`--mesh`,
             one CPU device by default) with synthetic batches as train.synthetic_data=True
             makes them (ssd.synthetic_batch)
  keras_fit  the same network (models/ssd.py's SSD, with Keras's own fused batch
             normalization put back, as a Keras user runs it) trained by plain
             `model.compile` + `model.fit` on one device, on the same synthetic batches
             already in memory: y = box and class targets, sample_weight = the weights,
             the loss = the same SSD loss (ssd.detection_losses) per image and the L2
             weight decay as a model loss

Both use the model config of `--gin_file` (default: the tiny SSD of the tests), tf_keras
SGD with momentum 0.9 at a constant learning rate, the same global batch and seed. Each
runs `--warmup` steps (compiling) then `--steps` timed ones; the rate is images of the
timed steps over the wall time from the end of the warm-up to the end of the last step.

The last line is one JSON object: images_per_sec (tfpod), keras_fit_images_per_sec,
vs_keras_fit, the settings, and each run's details ("runs"). A run that fails has
"error" (its last line of output) and the script exits 1 after the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from workers import best, rotate, run_worker  # bench/workers.py (scripts run from bench/)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUNS = ("tfpod", "keras_fit")
LEARNING_RATE = 0.01


def model_config(args):
    """(the SSD task, its model config from --gin_file)."""
    from tfpod.config import build_config, parse_config
    from tfpod.models import get_task

    parse_config([args.gin_file], [])
    task = get_task(build_config("experiment").model)
    if task.name != "ssd":
        raise SystemExit(f"--gin_file={args.gin_file} is not an SSD model config (experiment.model={task.name!r})")
    return task, build_config("ssd")


def run_tfpod(args) -> dict:
    """tfpod's Trainer and Controller on the mesh; the rate from metrics.jsonl times after the warm-up."""
    from tfpod import runtime

    runtime.initialize(cpu_devices=args.cpu_devices, device_type="CPU")
    from tfpod import api, controller, mesh as meshlib, optimizers, partitioning

    task, cfg = model_config(args)
    placement = partitioning.Placement.from_config(partitioning.ShardingConfig(), task.default_preset,
                                                   meshlib.make_mesh(args.mesh), check=False)
    train_cfg = controller.TrainConfig(steps=args.warmup + args.steps, global_batch_size=args.global_batch, seed=0,
                                       steps_per_loop=args.steps_per_loop, log_every=args.steps_per_loop,
                                       checkpoint_every=10**9, synthetic_data=True)
    opt = optimizers.OptimizerConfig(name="sgd", learning_rate=LEARNING_RATE, momentum=0.9, decay="constant",
                                     weight_decay=0.0, clip_norm=0)
    with tempfile.TemporaryDirectory() as model_dir:
        run = api.controller(task, cfg, train_cfg, opt, placement, model_dir)
        run.checkpoints.save = lambda **kwargs: None  # the final checkpoint is not part of the rate
        run.checkpoints.check_finite = lambda: None
        out = run.train()
        records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    times = {r["step"]: r["time"] for r in records if r["kind"] == "train"}
    result = _rate(args, times[args.warmup], times[args.warmup + args.steps], out["losses"][-1])
    result["traces"] = run.trainer.traces
    result["parameters"] = int(sum(v.shape.num_elements() for v in run.trainer.model.trainable_variables))
    return result


def stock_batch_norm(model) -> None:
    """Keras's own BatchNormalization (the fused kernel where Keras uses it) in place of tfpod's."""
    import tf_keras

    from tfpod import compat, fused

    for layer in compat.flatten_layers(model):
        if type(layer) is fused.BatchNormalization:
            layer.__class__ = tf_keras.layers.BatchNormalization
            layer.fused = True  # axis -1, no renorm or virtual batches: what Keras picks by default
            layer._data_format = "NHWC"  # what Keras's build sets for a fused layer (it was built unfused)


def run_keras_fit(args) -> dict:
    """tf_keras compile + fit of the same network on one device; per-step times from a callback."""
    import numpy as np
    import tensorflow as tf
    import tf_keras

    from tfpod.models import ssd

    task, cfg = model_config(args)
    tf_keras.utils.set_random_seed(0)
    model = ssd.SSD(cfg)
    model(ssd.model_inputs(task.synthetic_batch(cfg, 1, np.random.default_rng(0))))  # builds the blocks
    stock_batch_norm(model)
    model.add_loss(lambda: cfg.weight_decay * ssd.l2_penalty(model))

    def loss(y, predictions):  # y [batch, boxes, 5]: box targets, class target
        terms = ssd.detection_losses(predictions, y[..., :4], tf.cast(y[..., 4], tf.int32), cfg.negative_ratio)
        pos = terms["positives"]
        return (terms["box"] + terms["class"]) * tf.cast(pos > 0, tf.float32) / tf.maximum(pos, 1.0)  # [batch]

    batches = [task.synthetic_batch(cfg, args.global_batch, np.random.default_rng([0, step]))
               for step in range(args.warmup + args.steps)]
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    data = tf.data.Dataset.from_tensor_slices(stacked).map(lambda b: (
        {"images": b["images"]}, tf.concat([b["box_targets"], tf.cast(b["class_targets"], tf.float32)[..., None]], -1),
        b["weights"]))
    model.compile(optimizer=tf_keras.optimizers.legacy.SGD(LEARNING_RATE, momentum=0.9), loss=loss)
    ends = []

    class Times(tf_keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    history = model.fit(data.repeat().prefetch(2), epochs=1, steps_per_epoch=args.warmup + args.steps,
                        callbacks=[Times()], verbose=0)
    result = _rate(args, ends[args.warmup - 1], ends[-1], float(history.history["loss"][-1]))
    result["parameters"] = int(sum(v.shape.num_elements() for v in model.trainable_variables))
    return result


def _rate(args, start: float, end: float, loss: float) -> dict:
    return {"images_per_sec": args.steps * args.global_batch / (end - start), "step_time_s": (end - start) / args.steps,
            "loss": loss}


def run(name: str, args) -> dict:
    """One measurement in a fresh process; its JSON, or {"error": its last line}."""
    cmd = [sys.executable, os.path.abspath(__file__), f"--worker={name}"] + [
        f"--{k}={v}" for k, v in vars(args).items() if k not in ("worker", "runs", "repeats", "verbose")]
    result = run_worker(cmd, "ssd_throughput", name, ROOT, args.verbose)
    if "error" in result:
        return result
    print(f"[ssd_throughput] {name}: {result['images_per_sec']:,.1f} images/s ({result['process_wall_s']:.0f} s)",
          file=sys.stderr, flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gin_file", default="gin/model/ssd_tiny.gin", help="the SSD model config")
    p.add_argument("--global_batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (the first call compiles)")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--steps_per_loop", type=int, default=10, help="tfpod: steps per host call")
    p.add_argument("--mesh", default="data:1", help="tfpod's mesh")
    p.add_argument("--cpu_devices", type=int, default=1, help="logical CPU devices for tfpod")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--repeats", type=int, default=1, help="run the list this many times in rotation; best of each")
    p.add_argument("--verbose", action="store_true", help="show each run's log")
    p.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.warmup % args.steps_per_loop or args.steps % args.steps_per_loop:
        p.error(f"--warmup={args.warmup} and --steps={args.steps} must be positive multiples of "
                f"--steps_per_loop={args.steps_per_loop}")
    if args.worker:
        import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)

        print(json.dumps(run_tfpod(args) if args.worker == "tfpod" else run_keras_fit(args)), flush=True)
        return 0
    names = [n for n in args.runs.split(",") if n]
    trials = rotate(names, RUNS, args.repeats, lambda name: run(name, args), p.error)
    runs = {name: best(results, "images_per_sec") for name, results in trials.items()}
    rate = lambda name: runs.get(name, {}).get("images_per_sec")
    summary = {"model": args.gin_file, "global_batch": args.global_batch, "warmup": args.warmup, "steps": args.steps,
               "steps_per_loop": args.steps_per_loop, "mesh": args.mesh, "images_per_sec": rate("tfpod"),
               "keras_fit_images_per_sec": rate("keras_fit"),
               "vs_keras_fit": rate("tfpod") / rate("keras_fit") if rate("tfpod") and rate("keras_fit") else None,
               "runs": runs}
    print(json.dumps(summary), flush=True)
    return 1 if any("error" in r for results in trials.values() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
