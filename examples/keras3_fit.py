"""A Keras 3 model trained with Keras's own distribution API on TensorFlow, backed by tfpod.

    python examples/keras3_fit.py [--mesh=2,4] [--epochs=3] [--backup_dir=DIR]
    python -m tfpod.launch --num_hosts=2 --devices_per_host=4 -- python examples/keras3_fit.py --backup_dir=DIR

Keras's distribution guide, on TensorFlow: `keras.distribution.initialize()` (tfpod's
runtime; several hosts under tfpod.launch, SLURM or Kubernetes), a DeviceMesh of every
device of the job (`data` x `model`), a LayoutMap splitting the first Dense kernel over
`model`, `ModelParallel`, the guide's model (Flatten, Dense 200, Dropout, Dense 10) and its
random data, `compile` and `fit` with `keras.callbacks.BackupAndRestore`: run it again with
the same --backup_dir after a stop and it resumes from the last finished epoch. Each epoch
prints a JSON line ({"epoch", "loss"}); the last line of output is one JSON object (the
losses of the epochs this run trained; with --weights, host 0 writes the final weights there
as .npz).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfpod  # noqa: E402  (backs keras.distribution on TensorFlow once keras is imported)
import tfpod.console  # noqa: E402


def make_data(n: int = 128, batch: int = 16):
    """The guide's data: random images and targets, in batches (tf.data)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.RandomState(0)
    x = rng.normal(size=(n, 28, 28, 1)).astype("float32")
    y = rng.normal(size=(n, 10)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def build_model(dropout: float):
    """The guide's model; `d1` and `d2` are its layout-map keys."""
    import keras

    layers = keras.layers
    inputs = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs)
    y = layers.Dense(units=200, use_bias=False, activation="relu", name="d1")(y)
    y = layers.Dropout(dropout)(y)
    y = layers.Dense(units=10, activation="softmax", name="d2")(y)
    model = keras.Model(inputs=inputs, outputs=y)
    model.compile(loss="mse", optimizer="adam")
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2,4", help="data,model sizes; their product is the job's device count")
    parser.add_argument("--cpu_devices", type=int, default=8, help="logical CPU devices per host (CPU runs)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backup_dir", default=None, help="keras.callbacks.BackupAndRestore's folder")
    parser.add_argument("--stop_after_epoch", type=int, default=None, help="fail after this epoch (a preemption)")
    parser.add_argument("--weights", default=None, help="host 0 writes the final weights here (.npz)")
    args = parser.parse_args()
    os.environ.setdefault("TFPOD_CPU_DEVICES", str(args.cpu_devices))  # tfpod.launch sets it per host
    tfpod.console.setup()
    with tfpod.console.quiet():
        return run(args)


def run(args) -> int:
    import keras
    import numpy as np

    keras.distribution.initialize()  # tfpod's runtime: this host's devices, and the other hosts'
    keras.utils.set_random_seed(args.seed)  # every host computes the same initial weights
    data, model_axis = (int(s) for s in args.mesh.split(","))
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(shape=(data, model_axis), axis_names=["data", "model"], devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d2/output"] = ("data", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="data"))
    model = build_model(args.dropout)

    class Preempted(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if args.stop_after_epoch is not None and epoch + 1 == args.stop_after_epoch:
                raise SystemExit(f"preempted after epoch {epoch + 1}")

    def log_epoch(epoch, logs):
        print(json.dumps({"epoch": epoch + 1, "loss": logs["loss"]}), flush=True)

    callbacks = [keras.callbacks.LambdaCallback(on_epoch_end=log_epoch), Preempted()]
    if args.backup_dir:
        callbacks.insert(0, keras.callbacks.BackupAndRestore(args.backup_dir))
    history = model.fit(make_data(), epochs=args.epochs, callbacks=callbacks, shuffle=False, verbose=2)
    weights = model.get_weights()  # gathered on every host
    process = keras.distribution.distribution().num_processes
    if args.weights and tfpod.runtime.info().client_id == 0:
        np.savez(args.weights, *weights)
    print(json.dumps({"loss": history.history["loss"], "epochs": history.epoch, "hosts": process}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
