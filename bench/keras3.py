"""Keras 3 `fit` under keras.distribution on TensorFlow (tfpod/keras3) against plain Keras 3 `fit`.

For each model (an MLP, keras.applications.ResNet50, a KerasHub Llama causal LM) and each
variant, each in a process of its own with its own logical CPU devices (the cores are
shared among a process's devices, so one device gets every core):

  plain        Keras 3 with no distribution, one device
  data:1       DataParallel over one device (tfpod's DTensor step on one device)
  data:8       DataParallel over 8 devices (--devices)
  tf_keras     the same model in tf_keras, tfpod.sharding on data:8 and tfpod.input.to_mesh
               (tfpod's other Keras front end; MLP and ResNet50: KerasHub is Keras 3 only)

Each run fits --steps steps after one compiling epoch and reports the epoch's mean step time
(from the first batch's start to the end of training, over the batches: a step's own
callback interval is not its time, because a DTensor step is dispatched asynchronously and
Keras waits for it wherever it next reads a value, in the next batch's iteration or the
logs) and examples per second; the summary gives plain / data:1 (the goal is at least 0.95: the
backing costs no more than 5% on one device) and data:8 / data:1. On a CPU the 8 logical
devices share the host's cores, so data:8 measures the overhead of splitting, not a speed-up.

    python bench/keras3.py [--models=mlp,resnet50,llama] [--variants=plain,data:1,data:8,tf_keras]
                           [--size=default|tiny] [--steps=20]

The last line printed is one JSON object: the rows and the summary.
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

MODELS = ("mlp", "resnet50", "llama")
VARIANTS = ("plain", "data:1", "data:8", "tf_keras")
SIZES = {  # per model: (batch, shapes); tiny checks the bench runs
    "default": {"mlp": {"batch": 256, "features": 1024, "hidden": 4096},
                "resnet50": {"batch": 32, "image": 64},
                "llama": {"batch": 16, "length": 128, "vocab": 8192, "hidden": 256, "layers": 4, "heads": 8}},
    "tiny": {"mlp": {"batch": 16, "features": 32, "hidden": 64},
             "resnet50": {"batch": 8, "image": 32},
             "llama": {"batch": 8, "length": 16, "vocab": 64, "hidden": 16, "layers": 1, "heads": 2}},
}


def _data(name: str, size: dict, steps: int):
    import numpy as np

    rng = np.random.RandomState(0)
    n = size["batch"] * steps
    if name == "mlp":
        return rng.normal(size=(n, size["features"])).astype("float32"), rng.randint(0, 10, (n,)).astype("int32")
    if name == "resnet50":
        return (rng.uniform(-1, 1, (n, size["image"], size["image"], 3)).astype("float32"),
                rng.randint(0, 10, (n,)).astype("int32"))
    tokens = rng.randint(1, size["vocab"], (n, size["length"] + 1)).astype("int32")
    return ({"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, size["length"]), "int32")}, tokens[:, 1:])


def _keras3_model(name: str, size: dict):
    import keras

    if name == "mlp":
        inputs = keras.Input((size["features"],))
        x = keras.layers.Dense(size["hidden"], activation="relu")(inputs)
        x = keras.layers.Dense(size["hidden"], activation="relu")(x)
        model = keras.Model(inputs, keras.layers.Dense(10)(x))
    elif name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(size["image"],) * 2 + (3,), classes=10,
                                            classifier_activation=None)
    else:
        import keras_hub

        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=size["vocab"], num_layers=size["layers"], num_query_heads=size["heads"],
            num_key_value_heads=size["heads"] // 2, hidden_dim=size["hidden"], intermediate_dim=4 * size["hidden"],
            max_sequence_length=size["length"])
        model = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _tf_keras_model(name: str, size: dict):
    import tf_keras

    if name == "mlp":
        inputs = tf_keras.Input((size["features"],))
        x = tf_keras.layers.Dense(size["hidden"], activation="relu")(inputs)
        x = tf_keras.layers.Dense(size["hidden"], activation="relu")(x)
        return tf_keras.Model(inputs, tf_keras.layers.Dense(10)(x))
    return tf_keras.applications.ResNet50(weights=None, input_shape=(size["image"],) * 2 + (3,), classes=10,
                                          classifier_activation=None)


def run(name: str, variant: str, size_name: str, steps: int, devices: int) -> dict:
    """One model and variant, in this process: the mean step time of `steps` steps after one epoch."""
    size = SIZES[size_name][name]
    row = {"model": name, "variant": variant, "size": size_name, **size}
    x, y = _data(name, size, steps)
    timed: dict = {}  # the first batch's start, the training's end, the batches run

    def timer(callbacks_module):
        class Timer(callbacks_module.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                timed.setdefault("start", time.perf_counter())

            def on_train_batch_end(self, batch, logs=None):
                timed["batches"] = batch + 1

            def on_train_end(self, logs=None):
                timed["end"] = time.perf_counter()

        return Timer()

    started = time.time()
    if variant == "tf_keras":
        import tensorflow as tf
        import tf_keras

        import tfpod

        mesh = tfpod.make_mesh(f"data:{devices}")
        with tfpod.sharding(mesh):
            model = _tf_keras_model(name, size)
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-4),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = tfpod.input.to_mesh(tf.data.Dataset.from_tensor_slices((x, y)).batch(size["batch"]), mesh)
        model.fit(data, epochs=1, verbose=0)  # compiles
        model.fit(data, epochs=1, verbose=0, callbacks=[timer(tf_keras.callbacks)])
    else:
        import keras

        if variant != "plain":
            keras.distribution.set_distribution(keras.distribution.DataParallel(
                devices=keras.distribution.list_devices()[: int(variant.split(":")[1])]))
        keras.utils.set_random_seed(0)
        model = _keras3_model(name, size)
        fit = {"batch_size": size["batch"], "epochs": 1, "shuffle": False, "verbose": 0}
        model.fit(x, y, **fit)  # compiles
        model.fit(x, y, **fit, callbacks=[timer(keras.callbacks)])
    step = (timed["end"] - timed["start"]) / timed["batches"]
    row.update(step_s=round(step, 5), examples_per_s=round(size["batch"] / step, 1), steps=timed["batches"],
               seconds=round(time.time() - started, 1))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--size", default="default", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=8, help="logical CPU devices of the data:N variant")
    parser.add_argument("--one", default=None, help="MODEL/VARIANT in this process (internal)")
    args = parser.parse_args()
    if args.one:
        name, variant = args.one.split("/", 1)
        import tfpod  # noqa: F401  (tf_keras as tf.keras; keras.distribution backed)
        from tfpod import runtime

        devices = args.devices if variant in ("data:8", "tf_keras") else 1
        runtime.initialize(cpu_devices=devices, device_type="CPU")
        print(json.dumps(run(name, variant, args.size, args.steps, devices)), flush=True)
        return
    rows = []
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            if variant == "tf_keras" and name == "llama":
                continue  # KerasHub is Keras 3 only
            variant = variant.replace("data:8", f"data:{args.devices}")
            proc = subprocess.run([sys.executable, __file__, f"--one={name}/{variant}", f"--size={args.size}",
                                   f"--steps={args.steps}", f"--devices={args.devices}"],
                                  capture_output=True, text=True, cwd=ROOT)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            row = json.loads(lines[-1]) if lines else {
                "model": name, "variant": variant, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {}
    for name in args.models.split(","):
        step = {r["variant"]: r["step_s"] for r in rows if r["model"] == name and "step_s" in r}
        many = f"data:{args.devices}"
        if "plain" in step and "data:1" in step:
            summary[f"{name}_plain_over_data1"] = round(step["plain"] / step["data:1"], 3)  # goal >= 0.95
        if "data:1" in step and many in step:
            summary[f"{name}_data1_over_data{args.devices}"] = round(step["data:1"] / step[many], 3)
        if "tf_keras" in step and many in step:
            summary[f"{name}_tf_keras_over_keras3_data{args.devices}"] = round(step["tf_keras"] / step[many], 3)
    print(json.dumps({"rows": rows, "summary": summary}))


if __name__ == "__main__":
    main()
