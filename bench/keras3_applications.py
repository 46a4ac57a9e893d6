"""Keras 3's keras.applications under keras.distribution on TensorFlow (tfpod/keras3), against plain Keras 3.

Each model (weights=None, a small input, 5 classes) is built without a distribution and
under one (`--mesh=data:8`: DataParallel; `--mesh=batch:4,model:2`: ModelParallel with a
LayoutMap splitting every convolution and Dense kernel whose output channels divide over
`model`, named by exact path) from the same seed, in float64 (a step is discontinuous at
ReLU kinks, so float32 runs differ by chance where a pre-activation rounds to either side),
dropout left on (the masks are one device's), compiled with SGD(0.01) and sparse
cross-entropy and fit 2 steps on 16 fixed images; then evaluate and predict, `model.save`
(.keras) loaded by plain Keras 3, and `model.export` served by tf.saved_model.load. A row
"trains" when the losses, the weights after them (against the largest update), evaluate's
loss, predict's outputs, the loaded model's and the SavedModel's outputs are all within 1e-6
of plain Keras's; otherwise it says what happened (refused: tfpod's one line; or the differences).

    python bench/keras3_applications.py [--models=families|NAME,...] [--mesh=data:8] [--table=FILE]
    python bench/keras3_applications.py --results=rows.jsonl --table=docs/keras3_applications.md

Each model runs in its own process (a crash or a refusal does not stop the others). The last
line printed is JSON: the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import matrix_table  # noqa: E402  (bench/matrix_table.py)

# One model per family of keras.applications (the others of a family are built from the same layers).
FAMILIES = ["ConvNeXtTiny", "DenseNet121", "EfficientNetB0", "EfficientNetV2B0", "InceptionResNetV2", "InceptionV3",
            "MobileNet", "MobileNetV2", "MobileNetV3Small", "NASNetMobile", "ResNet50", "ResNet50V2", "VGG16",
            "Xception"]
SIZES = {"InceptionV3": 75, "InceptionResNetV2": 75, "Xception": 71}  # smallest inputs; the others take 32x32
MESHES = ("data:8", "batch:4,model:2")


def build(name: str, size: int):
    """The model, its layers named as in every other build: Keras numbers unnamed layers
    (conv2d_95) per process, and the LayoutMap is made from the plain model's paths, so each
    build starts from a cleared session (the distribution set, if any, set again)."""
    import keras

    distribution = keras.distribution.distribution()
    keras.backend.clear_session()
    if distribution is not None:
        keras.distribution.set_distribution(distribution)
    return getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=5)


def _largest(a_list, b_list) -> float:
    import numpy as np

    return max(float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
               for a, b in zip(a_list, b_list))


def distribution_for(mesh_spec: str, plain_model):
    """DataParallel over data:N, or ModelParallel splitting every kernel whose output channels divide."""
    import keras

    axes = [(a.split(":")[0], int(a.split(":")[1])) for a in mesh_spec.split(",")]
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh([s for _, s in axes], [n for n, _ in axes], devices)
    if len(axes) == 1:
        return keras.distribution.DataParallel(device_mesh=mesh)
    layout_map = keras.distribution.LayoutMap(mesh)
    for v in plain_model.weights:
        if v.path.endswith("/kernel") and len(v.shape) in (2, 4) and v.shape[-1] % mesh.shape[1] == 0:
            layout_map[v.path.replace(".", r"\.")] = (None,) * (len(v.shape) - 1) + ("model",)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=axes[0][0])


def matrix(name: str, mesh_spec: str, folder: str) -> dict:
    """One model's row (in this process)."""
    import numpy as np
    import tensorflow as tf

    import tfpod  # noqa: F401
    from tfpod import UserError

    os.environ.setdefault("TFPOD_CPU_DEVICES", "8")
    import keras

    keras.distribution.initialize()
    keras.config.set_floatx("float64")
    size = SIZES.get(name, 32)
    rng = np.random.RandomState(0)
    x, y = rng.uniform(-1, 1, (16, size, size, 3)), rng.randint(0, 5, (16,)).astype("int32")
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # one step per epoch: a loss per step
    row = {"model": name, "part": "matrix", "input": size, "mesh": mesh_spec}
    started = time.time()

    def fitted():
        keras.utils.set_random_seed(0)
        model = build(name, size)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy())
        return model, model.fit(train, epochs=2, verbose=0).history["loss"]

    try:
        keras.utils.set_random_seed(0)
        start = build(name, size).get_weights()
        plain, want = fitted()
        plain_eval, wanted = plain.evaluate(train, verbose=0), plain.predict(x, verbose=0)
        keras.distribution.set_distribution(distribution_for(mesh_spec, plain))
        t = time.time()
        model, got = fitted()
        row["sharded_fit_s"] = round(time.time() - t, 1)
    except UserError as e:
        return {**row, "result": "refused", "message": str(e), "seconds": round(time.time() - started, 1)}
    except Exception as e:  # noqa: BLE001  (a row of the table, not a crash of the bench)
        return {**row, "result": "error", "message": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                "seconds": round(time.time() - started, 1)}
    after, expected = model.get_weights(), plain.get_weights()
    row.update(params=int(sum(np.prod(w.shape) for w in plain.trainable_weights)), loss_sharded=got, loss_plain=want,
               split=sum(1 for v in model.weights
                         if "model" in tf.experimental.dtensor.fetch_layout(v.value).sharding_specs),
               loss_rel=float(np.max(np.abs(np.subtract(got, want)) / np.abs(want))),
               weights_rel=_largest(after, expected) / max(_largest(expected, start), 1e-30))
    row["evaluate_rel"] = abs(model.evaluate(train, verbose=0) - plain_eval) / abs(plain_eval)
    row["predict_max"] = _largest([model.predict(x, verbose=0)], [wanted])
    model.save(os.path.join(folder, "model.keras"))
    model.export(os.path.join(folder, "export"), verbose=False)
    keras.distribution.set_distribution(None)
    loaded = keras.models.load_model(os.path.join(folder, "model.keras"))
    row["loaded_max"] = _largest([loaded.predict(x, verbose=0)], [wanted])
    served = tf.saved_model.load(os.path.join(folder, "export"))
    row["saved_model_max"] = _largest([served.serve(tf.constant(x)).numpy()], [wanted])
    ok = all(row[k] <= 1e-6 for k in ("loss_rel", "weights_rel", "evaluate_rel", "predict_max", "loaded_max",
                                      "saved_model_max"))
    row["result"] = "trains" if ok else "differs"
    row["seconds"] = round(time.time() - started, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="families", help="families, or names")
    parser.add_argument("--mesh", default=",".join(MESHES).replace(",batch", ";batch"),
                        help="meshes separated by ';' (default: data:8;batch:4,model:2)")
    parser.add_argument("--one", default=None, help="run one model in this process (internal)")
    parser.add_argument("--results", default=None, help="read rows from this JSON-lines file instead of running")
    parser.add_argument("--table", default=None, help="write the Markdown table here")
    args = parser.parse_args()
    meshes = args.mesh.split(";")
    if args.one:
        folder = tempfile.mkdtemp(prefix="keras3_applications_")
        try:
            print(json.dumps(matrix(args.one, meshes[0], folder)), flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    if args.results:
        rows = matrix_table.read(args.results)
    else:
        names = FAMILIES if args.models == "families" else args.models.split(",")
        rows = []
        for name in names:
            for mesh in meshes:
                proc = subprocess.run([sys.executable, __file__, f"--one={name}", f"--mesh={mesh}"],
                                      capture_output=True, text=True, cwd=ROOT)
                lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
                row = json.loads(lines[-1]) if lines else {
                    "model": name, "mesh": mesh, "input": SIZES.get(name, 32), "result": "error",
                    "message": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.table:
        matrix_table.write(args.table, "keras3_applications.py", "tests/test_keras3_applications.py",
                           matrix_table.markdown(rows, MESHES, FAMILIES, lambda name: SIZES.get(name, 32)))
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
