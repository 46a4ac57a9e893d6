"""Keras 3's own distribution API on TensorFlow, backed by tfpod (tfpod/keras3/).

Every model trains under a distribution and plainly (no distribution: one device) from the
same seed, and the two runs' losses, metrics, predictions and weights are compared in
float32, as users run: the sharded runs differ from one device's only by the order of
float32 sums (seen: up to 1.5e-7 on the weights), so the tolerance is 2e-5 relative, 2e-6
absolute. Dropout is on: its masks are drawn as one device draws them (tfpod/keras3/random.py).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpod  # noqa: F401  (backs keras.distribution once keras is imported)
import tfpod.keras3.placement  # noqa: F401

keras = pytest.importorskip("keras")
from tfpod import UserError  # noqa: E402

RTOL, ATOL = 2e-5, 2e-6


pytestmark = pytest.mark.usefixtures("no_keras3_distribution")


def _layout(variable) -> list:
    """A Keras variable's DTensor layout as its sharding specs (None for an unsplit dimension)."""
    specs = dtensor.fetch_layout(variable.value).sharding_specs
    return [None if s == dtensor.UNSHARDED else s for s in specs]


def _guide_data():
    """The distribution guide's data: 128 random images and targets, batches of 16."""
    rng = np.random.RandomState(0)
    x = rng.normal(size=(128, 28, 28, 1)).astype("float32")
    y = rng.normal(size=(128, 10)).astype("float32")
    return x, y, tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def _guide_model(names=False):
    """The guide's model: Flatten, Dense(200, relu), Dropout(0.4), Dense(10, softmax)."""
    layers = keras.layers
    inputs = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs)
    y = layers.Dense(units=200, use_bias=False, activation="relu", name="d1" if names else None)(y)
    y = layers.Dropout(0.4)(y)
    y = layers.Dense(units=10, activation="softmax", name="d2" if names else None)(y)
    return keras.Model(inputs=inputs, outputs=y)


def _run(build, data, fit, evaluate=True, predict=None, seed=1):
    """Builds (seeded), compiles and fits a model under the current distribution: its history,
    evaluate's loss, predict's outputs and final weights."""
    keras.utils.set_random_seed(seed)
    model = build()
    model.compile(**fit.pop("compile"))
    history = model.fit(data, verbose=0, **fit).history
    out = {"history": history, "model": model}
    if evaluate:
        out["evaluate"] = model.evaluate(data, verbose=0)
    if predict is not None:
        out["predict"] = model.predict(predict, verbose=0, batch_size=32)
    out["weights"] = model.get_weights()
    return out


def _assert_same(sharded, plain):
    for key, values in plain["history"].items():
        np.testing.assert_allclose(sharded["history"][key], values, rtol=RTOL, atol=ATOL, err_msg=key)
    for key in ("evaluate", "predict"):
        if key in plain:
            np.testing.assert_allclose(sharded[key], plain[key], rtol=RTOL, atol=ATOL, err_msg=key)
    for a, b in zip(sharded["weights"], plain["weights"]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_the_guides_data_parallel_and_model_parallel_examples_train_with_one_devices_losses():
    """keras.io's distribution guide as written (DataParallel() over every device; ModelParallel
    on a (2, 4) data x model mesh with d1's kernel split over `model` and d2's output relaid
    out), then fit 3 epochs and evaluate as its first version did; against no distribution."""
    x, y, dataset = _guide_data()
    fit = lambda: {"compile": {"loss": "mse", "optimizer": "adam"}, "epochs": 3}  # noqa: E731
    plain = _run(lambda: _guide_model(names=True), dataset, fit(), predict=x)

    keras.distribution.initialize()  # tfpod's runtime (already started here): a no-op
    devices = keras.distribution.list_devices()
    assert devices == [f"cpu:{i}" for i in range(8)]
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    data_parallel = _run(lambda: _guide_model(names=True), dataset, fit(), predict=x)
    _assert_same(data_parallel, plain)
    model = data_parallel["model"]
    assert all(isinstance(v.value, dtensor.DVariable) and _layout(v) == [None] * len(v.shape) for v in model.weights)
    assert dtensor.fetch_layout(model.weights[0].value).mesh.dim_names == ["batch"]

    mesh = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=["data", "model"], devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/output"] = ("data", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="data"))
    model_parallel = _run(lambda: _guide_model(names=True), dataset, fit(), predict=x)
    _assert_same(model_parallel, plain)
    model = model_parallel["model"]
    kernel = model.get_layer("d1").kernel
    assert _layout(kernel) == [None, "model"]
    assert _layout(model.get_layer("d2").kernel) == [None, None]
    slots = {v.path.split("/")[1]: _layout(v) for v in model.optimizer.variables}
    assert slots["d1_kernel_momentum"] == slots["d1_kernel_velocity"] == [None, "model"]
    assert slots["iteration"] == slots["learning_rate"] == []
    assert kernel.numpy().shape == (784, 200)  # gathered
    np.testing.assert_allclose(model(x[:4]), plain["predict"][:4], rtol=RTOL, atol=ATOL)  # an eager call


class Subclassed(keras.Model):
    """A subclassed model: two Dense layers around LayerNormalization and Dropout."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(32, activation="gelu", name="up")
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.drop = keras.layers.Dropout(0.25)
        self.down = keras.layers.Dense(3, name="down")

    def call(self, x, training=False):
        return self.down(self.drop(self.norm(self.up(x)), training=training))


def test_a_subclassed_model_on_arrays_trains_with_one_devices_losses_and_metrics():
    """A subclassed model on NumPy arrays under ModelParallel (data:4, model:2, `up` split by
    columns, `down` by rows): sample weights, a last batch of 6 rows that does not split over
    4 shards (run replicated), steps_per_execution=3, validation data, accuracy; then
    train_on_batch, test_on_batch and predict_on_batch. Against no distribution."""
    rng = np.random.RandomState(3)
    x = rng.normal(size=(70, 12)).astype("float32")
    y = rng.randint(0, 3, size=(70,))
    w = rng.uniform(0.5, 1.5, size=(70,)).astype("float32")
    compile_args = {"optimizer": keras.optimizers.SGD(0.1, momentum=0.9), "steps_per_execution": 3,
                    "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    "metrics": ["accuracy"]}

    def run():
        keras.utils.set_random_seed(2)
        model = Subclassed()
        model.compile(**{**compile_args, "optimizer": keras.optimizers.SGD(0.1, momentum=0.9)})
        history = model.fit(x, y, sample_weight=w, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            validation_data=(x[:32], y[:32])).history
        on_batch = [model.train_on_batch(x[:8], y[:8]), model.test_on_batch(x[:8], y[:8])]
        return {"history": history, "evaluate": on_batch, "predict": model.predict_on_batch(x[:8]),
                "weights": model.get_weights(), "model": model}

    plain = run()
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"], keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")  # paths in a subclassed model: subclassed/up/kernel
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    with distribution.scope():
        sharded = run()
    _assert_same(sharded, plain)
    assert set(plain["history"]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    model = sharded["model"]
    assert _layout(model.up.kernel) == [None, "model"] and _layout(model.down.kernel) == ["model", None]
    assert _layout(model.norm.gamma) == [None]


@pytest.mark.unit
def test_nothing_runs_unsharded_without_a_word():
    """A model built before the distribution, a layout that does not fit its variable, and a
    Keras 3 model given to tfpod's tf_keras front end each stop with one line."""
    x = np.zeros((8, 4), "float32")
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    plain.compile(loss="mse")
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    with pytest.raises(UserError, match=r"built before the distribution was set: its variables \(sequential/d/kernel, "
                                        r"sequential/d/bias\) "
                                        r"are on one device"):
        plain.fit(x, x[:, :2], verbose=0)

    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*/d/kernel"] = (None, "model")   # 6 columns over 4
    layout_map[".*/e/kernel"] = ("model",)        # rank 1 for a rank-2 kernel
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    with pytest.raises(UserError, match=r"variable 'sequential_1/d/kernel' of shape \(4, 6\): dimension 1 \(6\) does "
                                        r"not divide "
                                        r"over mesh axis 'model' of size 4"):
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="d")])
    with pytest.raises(UserError, match=r"variable 'sequential_2/e/kernel' of shape \(4, 4\) was given a layout of "
                                        r"rank 1"):
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="e")])

    placed = keras.distribution.distribute_tensor(np.arange(32.0).reshape(8, 4),
                                                  keras.distribution.TensorLayout(("batch", "model"), mesh))
    assert dtensor.fetch_layout(placed).sharding_specs == ["batch", "model"]
    np.testing.assert_array_equal(tfpod.keras3.placement.gather(placed), np.arange(32.0).reshape(8, 4))

    keras.distribution.set_distribution(None)
    with pytest.raises(UserError, match=r"tfpod.keras.unsharded: the Sequential 'sequential' is a Keras 3 object .*"
                                        r"keras.distribution.set_distribution"):
        tfpod.keras.unsharded(plain)
    with pytest.raises(UserError, match=r"the Keras 3 variable 'sequential_3/dense/kernel' is made inside "
                                        r"tfpod.sharding.*Keras 3 "
                                        r"model \(import keras\) use Keras's own distribution API"):
        with tfpod.sharding(tfpod.make_mesh("data:-1,model:2")):
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


def test_keras_imported_before_tfpod_is_backed_too():
    """`import keras` then `import tfpod` backs keras.distribution as the other order does."""
    import subprocess
    import sys

    from conftest import ROOT

    script = ("import keras, tfpod, tfpod.keras3; "
              "from keras.src.backend.tensorflow import distribution_lib as d; "
              "print(tfpod.keras3.installed(), d.distribute_value.__module__)")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "tfpod.keras3.backend"], out.stderr[-2000:]
