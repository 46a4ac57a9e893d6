"""Your own tf_keras model, trained tensor-parallel with model.fit on a DTensor mesh.

    python examples/keras_fit.py [--mesh=data:4,model:2] [--cpu_devices=8] [--epochs=5]
                                 [--steps_per_execution=4] [--model_dir=DIR]

A plain functional Keras MLP classifier (two Megatron-style blocks: the first kernel
of each split by columns over `model`, the second by rows, so each block needs one
all-reduce) is built under `tfpod.sharding`, compiled and fit with Keras's own
`compile` / `fit` / `evaluate` / `predict`, with TensorBoard, EarlyStopping and
tfpod's checkpoint callback. The data is synthetic: a fixed random "teacher" network
labels Gaussian inputs, so the task is learnable and needs no download.

The same model is then fit unsharded (one device, no mesh) from the same initial
weights on the same batches, and the largest relative difference of the per-epoch
losses is reported: the sharded run computes the same thing.

Run it again with the same --model_dir and it resumes from the newest checkpoint.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpod  # noqa: E402  (selects tf_keras before TensorFlow loads)

FEATURES, HIDDEN, CLASSES = 64, 256, 10
RULES = {
    # path regex (a functional model's paths are <layer name>.<weight>) -> logical axes;
    # the `tensor` preset maps `mlp` to the `model` mesh axis.
    r"block\d_up\.kernel": ("embed", "mlp"),
    r"block\d_up\.bias": ("mlp",),
    r"block\d_down\.kernel": ("mlp", "embed"),
}


def build_model():
    import tf_keras

    inputs = tf_keras.Input((FEATURES,), name="features")
    x = inputs
    for i in range(2):
        h = tf_keras.layers.Dense(HIDDEN, activation="gelu", name=f"block{i}_up")(x)
        h = tf_keras.layers.Dense(FEATURES, name=f"block{i}_down")(h)
        x = tf_keras.layers.LayerNormalization(name=f"block{i}_norm")(x + h)
    return tf_keras.Model(inputs, tf_keras.layers.Dense(CLASSES, name="logits")(x), name="mlp")


def make_data(n: int, seed: int):
    """Inputs ~ N(0, 1); labels = argmax of a fixed random two-layer teacher network."""
    import numpy as np

    teacher = np.random.default_rng(1234)
    w1 = teacher.normal(size=(FEATURES, 32)) / np.sqrt(FEATURES)
    w2 = teacher.normal(size=(32, CLASSES)) / np.sqrt(32)
    x = np.random.default_rng(seed).normal(size=(n, FEATURES)).astype("float32")
    y = (np.tanh(x @ w1) @ w2).argmax(-1).astype("int32")
    return x, y


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data:4,model:2")
    parser.add_argument("--cpu_devices", type=int, default=8, help="logical CPU devices (CPU runs)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=64, help="global batch")
    parser.add_argument("--train_examples", type=int, default=2048)
    parser.add_argument("--steps_per_execution", type=int, default=4)
    parser.add_argument("--model_dir", default=None, help="checkpoints and TensorBoard (default: a new temp dir)")
    args = parser.parse_args()

    from tfpod import runtime

    try:
        runtime.initialize(cpu_devices=args.cpu_devices)
        import tensorflow as tf
        import tf_keras

        from tfpod import keras as tk

        mesh = tfpod.make_mesh(args.mesh)
        model_dir = args.model_dir or tempfile.mkdtemp(prefix="keras_fit_")
        x, y = make_data(args.train_examples, seed=0)
        vx, vy = make_data(1024, seed=1)
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size, drop_remainder=True)
        val = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(args.batch_size, drop_remainder=True)

        tf_keras.utils.set_random_seed(0)
        with tfpod.sharding(mesh, rules=RULES) as placement:
            model = build_model()
        print(placement.report(f"{model.name} variables"), flush=True)

        def compile_(m, steps_per_execution=1):
            m.compile(optimizer=tf_keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=steps_per_execution)

        compile_(model, args.steps_per_execution)
        initial = model.get_weights()
        checkpoints = tk.Checkpoint(model_dir, every_n_epochs=1, keep=2)
        callbacks = [
            checkpoints,
            tf_keras.callbacks.TensorBoard(os.path.join(model_dir, "tensorboard")),
            tf_keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
        ]
        t = time.time()
        history = model.fit(tk.to_mesh(train, mesh), validation_data=tk.to_mesh(val, mesh), epochs=args.epochs,
                            callbacks=callbacks, verbose=2).history
        fit_seconds = time.time() - t
        val_loss, val_accuracy = model.evaluate(tk.to_mesh(val, mesh), verbose=0)
        probabilities = tf.nn.softmax(model.predict(tk.to_mesh(val, mesh), verbose=0)).numpy()
        print(f"evaluate: val_loss {val_loss:.4f} val_accuracy {val_accuracy:.4f}; "
              f"predict: {probabilities.shape[0]} rows, first argmax {probabilities[:8].argmax(-1).tolist()}", flush=True)

        max_rel = None
        if checkpoints.restored_step is None and history.get("loss"):
            # The same model, one device, no mesh, from the same weights on the same batches.
            plain = build_model()
            plain.set_weights(initial)
            compile_(plain)
            reference = plain.fit(train, validation_data=val, epochs=len(history["loss"]), verbose=0).history
            max_rel = float(max(abs(a - b) / abs(b) for a, b in zip(history["loss"], reference["loss"])))
            print(f"unsharded fit losses {[round(v, 5) for v in reference['loss']]}; "
                  f"max relative difference {max_rel:.2e}", flush=True)
        result = {
            "mesh": args.mesh, "epochs_run": len(history.get("loss", [])),
            "resumed_from_step": checkpoints.restored_step,
            "loss": history["loss"][-1] if history.get("loss") else None,
            "val_loss": float(val_loss), "val_accuracy": float(val_accuracy),
            "max_rel_diff_vs_unsharded": max_rel, "fit_seconds": round(fit_seconds, 2),
            "checkpoint": checkpoints.manager.latest, "model_dir": model_dir,
            "split_over_model": [s.name for s in placement.specs.values()
                                 if "model" in placement.layouts[s.name].sharding_specs],
        }
        print(json.dumps(result))
        return 0
    except tfpod.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
