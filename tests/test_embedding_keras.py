"""Keras `fit` with a tf_keras Embedding whose rows are split (tfpod.keras.tables): the same
sparse lookups and updates as tfpod's trainer, equal to plain tf_keras; a model built
from tensorflow-recommenders' layers (its DCN `Cross`) trains the same way."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

import tfpod
from tfpod import keras as tk

ROWS, WIDTH, HOT = 64, 8, 3


def model(cross=None):
    ids = tf_keras.Input((HOT,), dtype="int32", name="ids")
    dense = tf_keras.Input((4,), name="dense")
    rows = tf_keras.layers.Embedding(ROWS, WIDTH, name="table")(ids)  # [batch, hot, width]
    x = tf_keras.layers.Concatenate()([tf_keras.layers.Flatten()(rows), dense])
    if cross is not None:
        x = cross(x)
    return tf_keras.Model([ids, dense], tf_keras.layers.Dense(1, name="head")(x))


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 10, (n, HOT)).astype(np.int32)  # few ids: repeats in every batch
    dense = rng.normal(size=(n, 4)).astype(np.float32)
    return {"ids": ids, "dense": dense}, rng.normal(size=(n, 1)).astype(np.float32)


@pytest.mark.parametrize("with_cross", [False, True])
def test_keras_embedding_split_by_rows_trains_sparsely_as_plain_keras(with_cross):
    """data:4,model:2, the table's rows over `model`: fit (Adagrad, steps_per_execution 2) takes
    the sparse path (no one-hot matmul, no dense table gradient) and its losses, table and
    accumulators equal plain tf_keras's sparse Adagrad on one device."""
    cross = None
    if with_cross:
        tfrs = pytest.importorskip("tensorflow_recommenders")  # (setup.py's test extra installs it)
        cross = lambda: tfrs.layers.dcn.Cross(projection_dim=4, kernel_initializer="glorot_uniform", name="cross")
    mesh = tfpod.make_mesh("data:4,model:2")
    tf_keras.utils.set_random_seed(0)
    plain = model(cross() if cross else None)
    with tfpod.sharding(mesh, rules={r"table\.embeddings": ("vocab", None)}):
        sharded = model(cross() if cross else None)
    sharded.set_weights(plain.get_weights())
    loss = tf_keras.losses.MeanSquaredError()
    plain.compile(tf_keras.optimizers.legacy.Adagrad(0.1), loss=loss, run_eagerly=True)
    sharded.compile(tf_keras.optimizers.legacy.Adagrad(0.1), loss=loss, steps_per_execution=2)
    assert tk.tables.has_tables(sharded)
    assert tuple(tk.layout_of(sharded.get_layer("table").embeddings).sharding_specs) == ("model", dtensor.UNSHARDED)
    x, y = data()
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    got = sharded.fit(tk.to_mesh(train, mesh), epochs=2, verbose=0).history["loss"]
    want = plain.fit(train, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    accumulator = lambda m: m.optimizer.get_slot(m.get_layer("table").embeddings, "accumulator")
    np.testing.assert_allclose(tk.get_values([accumulator(sharded)])[0], accumulator(plain).numpy(), rtol=1e-5)
    # evaluate and predict: the same lookups (one step per call), the same function
    np.testing.assert_allclose(sharded.predict(tk.to_mesh(train, mesh), verbose=0), plain.predict(train, verbose=0),
                               rtol=1e-5, atol=1e-6)
