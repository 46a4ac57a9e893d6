"""Saving a Keras 3 model trained under keras.distribution (tfpod/keras3/): `model.save` writes
an ordinary .keras file (weights gathered) that plain Keras 3 loads, `keras.callbacks.
BackupAndRestore` and `ModelCheckpoint` resume exactly (bit-equal weights to an uninterrupted
run on the same mesh), and `model.export` writes a SavedModel that `tf.saved_model.load` serves.

The model has no dropout: Keras 3 keeps no SeedGenerator state in its checkpoints (on any
backend), so a resumed run's masks differ from an uninterrupted one's, under a distribution
exactly as without one (docs/keras.md).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpod  # noqa: F401  (backs keras.distribution once keras is imported)

keras = pytest.importorskip("keras")

L = keras.layers


pytestmark = pytest.mark.usefixtures("no_keras3_distribution")


def _model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    y = L.Dense(8, activation="relu", name="up")(inputs)
    y = L.LayerNormalization(name="norm")(y)
    model = keras.Model(inputs, L.Dense(2, name="down")(y))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


class _Preempted(keras.callbacks.Callback):
    """Stops training with an error at the end of the second epoch (after the checkpoints)."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("preempted")


def test_save_load_resume_and_export(tmp_path):
    rng = np.random.RandomState(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 2)).astype("float32")
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"], keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    keras.distribution.set_distribution(distribution)
    fit = {"batch_size": 8, "epochs": 4, "shuffle": False, "verbose": 0}

    whole = _model(1)
    whole_loss = whole.fit(x, y, **fit).history["loss"]
    weights = whole.get_weights()

    with pytest.raises(RuntimeError, match="preempted"):
        _model(1).fit(x, y, **fit, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
                                             keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch_{epoch}.keras")),
                                             _Preempted()])
    resumed = _model(7)  # other initial weights: everything must come from the backup
    resumed_loss = resumed.fit(x, y, **fit, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert resumed_loss.history["loss"] == whole_loss[2:]
    for a, b in zip(resumed.get_weights(), weights):
        np.testing.assert_array_equal(a, b)

    reloaded = keras.models.load_model(tmp_path / "epoch_2.keras")  # under the distribution: on the mesh
    assert dtensor.fetch_layout(reloaded.get_layer("up").kernel.value).sharding_specs == [dtensor.UNSHARDED, "model"]
    assert reloaded.fit(x, y, **{**fit, "initial_epoch": 2}).history["loss"] == whole_loss[2:]
    for a, b in zip(reloaded.get_weights(), weights):
        np.testing.assert_array_equal(a, b)

    expected = whole.predict(x, verbose=0)
    whole.save(tmp_path / "model.keras")
    whole.export(str(tmp_path / "export"), verbose=False)
    assert dtensor.is_dtensor(whole.get_layer("up").kernel.value.read_value())  # still on the mesh
    keras.distribution.set_distribution(None)
    plain = keras.models.load_model(tmp_path / "model.keras")  # plain Keras 3: one device, weights gathered
    assert not dtensor.is_dtensor(plain.get_layer("up").kernel.value.read_value())
    for a, b in zip(plain.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, rtol=0, atol=1e-6)
    served = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(served.serve(tf.constant(x)).numpy(), expected, rtol=0, atol=1e-6)
