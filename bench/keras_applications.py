"""tf_keras.applications under Keras `fit`, sharded by tfpod, against plain tf_keras.

Two parts (`--parts`):

  matrix   each model (weights=None, a small input, 5 classes) built plainly and under
           `tfpod.sharding(mesh)` (default rules) from the same weights, in float64 (one
           step of these models is discontinuous at ReLU/ReLU6 kinks, so float32 results
           differ by chance where a pre-activation rounds to either side: see
           tests/test_keras.py's MobileNetV2 test), dropout rates set to 0 on both sides
           (their random masks differ), compiled with SGD(0.01) and sparse cross-entropy,
           fit 2 steps on 16 fixed images (the plain model eagerly, the sharded one as fit
           compiles it); then evaluate and predict on the same images,
           and get_weights / set_weights round-tripped; the fit saved a tfpod.keras.Checkpoint,
           from which a new sharded model (other initial weights) resumes, and model.save
           writes a SavedModel, served by tf.saved_model.load. "trains" means: both losses within
           1e-6 (relative) of plain Keras's, the weights after them within 1e-6 of the
           largest update, evaluate's loss and predict's outputs within 1e-6, the resumed
           model's weights equal to the trained ones, the SavedModel's outputs within 1e-6
           of plain predict's. Otherwise the
           row says what happened: refused (tfpod's one line), or the differences.
  speed    plain `fit` against sharded `fit` on data:N (N = --cpu_devices), float32,
           batch 32, the median step time after compiling (--models, default
           ResNet50V2,EfficientNetB0,DenseNet121 at 64x64).

Each model runs in its own process (a crash or a refusal does not stop the others).

    python bench/keras_applications.py --parts=matrix [--models=families|all|NAME,...] [--table=FILE]
    python bench/keras_applications.py --parts=speed [--models=ResNet50V2,...] [--steps=6]

`--table` writes the matrix as a Markdown table (docs/keras.md includes it). The last line
printed is JSON: one record per model and part.
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

import matrix_table  # noqa: E402  (bench/matrix_table.py)

# One model per family (the others of a family are built from the same layers).
FAMILIES = ["ConvNeXtTiny", "DenseNet121", "EfficientNetB0", "EfficientNetV2B0", "InceptionResNetV2", "InceptionV3",
            "MobileNet", "MobileNetV2", "MobileNetV3Small", "NASNetMobile", "RegNetX002", "ResNet50", "ResNet50V2",
            "ResNetRS50", "VGG16", "Xception"]
# Smallest inputs the models accept (the others take 32x32).
SIZES = {"InceptionV3": 75, "InceptionResNetV2": 75, "Xception": 71, "NASNetMobile": 32, "NASNetLarge": 32}
SPEED = ["ResNet50V2", "EfficientNetB0", "DenseNet121"]


def all_models() -> list[str]:
    import tf_keras

    return sorted(n for n in dir(tf_keras.applications) if n[0].isupper() and callable(getattr(tf_keras.applications, n)))


def build(name: str, size: int):
    import tf_keras

    return getattr(tf_keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=5)


def _largest(a_list, b_list) -> float:
    import numpy as np

    return max(float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()) for a, b in zip(a_list, b_list))


def matrix(name: str, devices: int, mesh_spec: str) -> dict:
    """One model's matrix row (in this process)."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="keras_applications_")  # its checkpoints and SavedModel
    try:
        return _matrix(name, devices, mesh_spec, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _matrix(name: str, devices: int, mesh_spec: str, folder: str) -> dict:
    import numpy as np
    import tensorflow as tf
    import tf_keras

    import tfpod
    from tfpod import UserError, runtime

    runtime.initialize(cpu_devices=devices, device_type="CPU")
    size = SIZES.get(name, 32)
    rng = np.random.RandomState(0)
    x, y = rng.uniform(-1, 1, (16, size, size, 3)), rng.randint(0, 5, (16,)).astype("int32")
    mesh = tfpod.make_mesh(mesh_spec)
    tf_keras.utils.set_random_seed(0)
    row = {"model": name, "part": "matrix", "input": size, "mesh": mesh_spec}
    started = time.time()

    def built(sharded: bool):
        tf_keras.backend.set_floatx("float64")
        tf_keras.mixed_precision.set_global_policy("float64")
        try:
            if not sharded:
                return build(name, size)
            with tfpod.sharding(mesh):
                return build(name, size)
        finally:  # float64 layers; the optimizers as usual (as tests/test_keras.py's MobileNetV2 test)
            tf_keras.mixed_precision.set_global_policy("float32")
            tf_keras.backend.set_floatx("float32")

    def compiled(m, plain=False):
        for layer in m._flatten_layers():  # dropout off: the same function on both sides (random masks differ)
            if isinstance(layer, tf_keras.layers.Dropout):
                layer.rate = 0.0
        m.compile(optimizer=tf_keras.optimizers.SGD(0.01), loss=tf_keras.losses.SparseCategoricalCrossentropy(),
                  run_eagerly=plain)
        return m

    try:
        plain, model = built(False), built(True)
        start = plain.get_weights()
        model.set_weights(start)
        compiled(plain, plain=True)
        compiled(model)
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # one step per epoch: a loss per step
        t = time.time()
        got = model.fit(tfpod.input.to_mesh(train, mesh), epochs=2, verbose=0,
                        callbacks=[tfpod.keras.Checkpoint(folder)]).history["loss"]
        row["sharded_fit_s"] = round(time.time() - t, 1)
        want = plain.fit(train, epochs=2, verbose=0).history["loss"]
    except UserError as e:
        return {**row, "result": "refused", "message": str(e), "seconds": round(time.time() - started, 1)}
    except Exception as e:  # noqa: BLE001  (a row of the table, not a crash of the bench)
        return {**row, "result": "error", "message": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                "seconds": round(time.time() - started, 1)}
    after, expected = model.get_weights(), plain.get_weights()
    update = _largest(expected, start)
    row.update(params=int(sum(np.prod(w.shape) for w in plain.trainable_weights)),
               loss_sharded=[float(v) for v in np.ravel(got)], loss_plain=[float(v) for v in np.ravel(want)],
               loss_rel=float(np.max(np.abs(np.subtract(got, want)) / np.abs(want))),
               weights_rel=_largest(after, expected) / max(update, 1e-30))
    eval_sharded = model.evaluate(tfpod.input.to_mesh(train, mesh), verbose=0)
    eval_plain = plain.evaluate(train, verbose=0)
    row["evaluate_rel"] = abs(eval_sharded - eval_plain) / abs(eval_plain)
    row["predict_max"] = _largest([model.predict(tfpod.input.to_mesh(train, mesh), verbose=0)],
                                  [plain.predict(train, verbose=0)])
    tf_keras.utils.set_random_seed(1)
    resumed = compiled(built(True))  # other initial weights; resumes at step 2 of 2: nothing to train
    resumed.fit(tfpod.input.to_mesh(train, mesh), epochs=2, verbose=0, callbacks=[tfpod.keras.Checkpoint(folder)])
    row["resume_exact"] = _largest(resumed.get_weights(), after) == 0.0
    model.save(os.path.join(folder, "saved_model"))
    served = tf.saved_model.load(os.path.join(folder, "saved_model")).signatures["serving_default"]
    row["saved_model_max"] = _largest([list(served(tf.constant(x)).values())[0]], [plain.predict(train, verbose=0)])
    model.set_weights(start)
    row["set_get_exact"] = _largest(model.get_weights(), start) == 0.0
    ok = (row["loss_rel"] <= 1e-6 and row["weights_rel"] <= 1e-6 and row["evaluate_rel"] <= 1e-6
          and row["predict_max"] <= 1e-6 and row["set_get_exact"] and row["resume_exact"]
          and row["saved_model_max"] <= 1e-6)
    row["result"] = "trains" if ok else "differs"
    row["seconds"] = round(time.time() - started, 1)
    return row


def speed(name: str, devices: int, steps: int) -> dict:
    """Plain and sharded fit's median step time (in this process)."""
    import numpy as np
    import tensorflow as tf
    import tf_keras

    import tfpod
    from tfpod import runtime

    runtime.initialize(cpu_devices=devices, device_type="CPU")
    rng = np.random.RandomState(0)
    x, y = rng.rand(32 * steps, 64, 64, 3).astype("float32"), rng.randint(0, 5, (32 * steps,)).astype("int32")
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    mesh = tfpod.make_mesh(f"data:{devices}")
    row = {"model": name, "part": "speed", "mesh": f"data:{devices}", "batch": 32, "input": 64}

    class Times(tf_keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.t)

    for variant in ("plain", "sharded"):
        tf_keras.utils.set_random_seed(0)
        if variant == "sharded":
            with tfpod.sharding(mesh):
                model = build(name, 64)
            data = tfpod.input.to_mesh(train, mesh)
        else:
            model, data = build(name, 64), train
        model.compile(optimizer=tf_keras.optimizers.SGD(0.01), loss=tf_keras.losses.SparseCategoricalCrossentropy())
        timer = Times()
        timer.times = []
        t = time.time()
        model.fit(data, epochs=1, verbose=0, callbacks=[timer])
        row[f"{variant}_first_s"] = round(timer.times[0], 2)
        row[f"{variant}_step_s"] = round(float(np.median(timer.times[1:])), 4)
        row[f"{variant}_images_per_s"] = round(32 / float(np.median(timer.times[1:])), 1)
        row[f"{variant}_total_s"] = round(time.time() - t, 1)
    row["sharded_over_plain"] = round(row["sharded_step_s"] / row["plain_step_s"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="matrix", choices=["matrix", "speed"])
    parser.add_argument("--models", default=None, help="families (default for matrix), all, or names")
    parser.add_argument("--mesh", default="data:4,model:2")
    parser.add_argument("--cpu_devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--table", default=None, help="write the matrix as a Markdown table here")
    parser.add_argument("--results", default=None,
                        help="make --table from these JSON lines (tests/test_keras_applications.py's), running nothing")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per model (its row then says so)")
    parser.add_argument("--one", default=None, help="(internal) run one model in this process")
    args = parser.parse_args()
    if args.results:
        rows = matrix_table.read(args.results)
        matrix_table.write(args.table or "/dev/stdout", "keras_applications.py", "tests/test_keras_applications.py",
                           matrix_table.markdown(rows))
        return
    if args.one:
        row = (matrix(args.one, args.cpu_devices, args.mesh) if args.parts == "matrix"
               else speed(args.one, args.cpu_devices, args.steps))
        print(json.dumps(row))
        return
    names = args.models or ("families" if args.parts == "matrix" else ",".join(SPEED))
    names = FAMILIES if names == "families" else all_models() if names == "all" else names.split(",")
    rows = []
    for name in names:
        try:
            proc = subprocess.run([sys.executable, __file__, f"--parts={args.parts}", f"--one={name}",
                                   f"--mesh={args.mesh}", f"--cpu_devices={args.cpu_devices}", f"--steps={args.steps}"],
                                  capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            row = {"model": name, "part": args.parts, "result": "timeout", "message": f"over {args.timeout} s"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        why = (f"killed by signal {-proc.returncode} (SIGKILL: out of memory?)" if proc.returncode < 0
               else (proc.stderr.strip().splitlines() or ["?"])[-1][:300])
        row = json.loads(lines[-1]) if lines else {"model": name, "part": args.parts, "result": "crashed",
                                                    "message": why}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.table and args.parts == "matrix":
        matrix_table.write(args.table, "keras_applications.py", "tests/test_keras_applications.py",
                           matrix_table.markdown(rows))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
