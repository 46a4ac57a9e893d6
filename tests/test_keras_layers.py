"""Which common tf_keras layers train sharded (the README's table "What trains sharded").

Each layer sits in a small functional model (input -> layer -> flatten -> dense) built
under `tfpod.sharding` on data:8 and fit on batch-sharded data; a layer that trains must
give the losses of the same model fit unsharded from the same weights, and one that
cannot must be refused at compile with one line naming the op.
"""

import numpy as np
import tensorflow as tf
import tf_keras

import tfpod
from tfpod import UserError

L = tf_keras.layers
SEQ, IMG, VOL, IDS = (6, 5), (8, 8, 3), (4, 4, 4, 2), (6,)

# name: (input shape, layer factory, None if it trains, else the op named at compile)
LAYERS = {
    "Dense": (SEQ, lambda: L.Dense(4), None),
    "Embedding": (IDS, lambda: L.Embedding(20, 4), None),
    "OnDeviceEmbedding": (IDS, "mg_embedding", None),
    "Conv1D": (SEQ, lambda: L.Conv1D(4, 3, padding="causal"), None),
    "Conv2D": (IMG, lambda: L.Conv2D(4, 3, strides=2, padding="same"), None),
    "Conv3D": (VOL, lambda: L.Conv3D(2, 3, padding="same"), None),
    "Conv2DTranspose": (IMG, lambda: L.Conv2DTranspose(4, 3, strides=2, padding="same"), None),
    "DepthwiseConv2D": (IMG, lambda: L.DepthwiseConv2D(3, strides=2, padding="same"), None),
    "SeparableConv2D": (IMG, lambda: L.SeparableConv2D(4, 3, padding="same"), None),
    "DepthwiseConv1D": (SEQ, lambda: L.DepthwiseConv1D(3, padding="same"), None),
    "SeparableConv1D": (SEQ, lambda: L.SeparableConv1D(4, 3, padding="same"), None),
    "MaxPooling2D": (IMG, lambda: L.MaxPooling2D(), None),
    "AveragePooling2D": (IMG, lambda: L.AveragePooling2D(), None),
    "GlobalMaxPooling2D": (IMG, lambda: L.GlobalMaxPooling2D(), None),
    "UpSampling2D": (IMG, lambda: L.UpSampling2D(interpolation="bilinear"), None),
    "ZeroPadding2D": (IMG, lambda: L.ZeroPadding2D(), None),
    "BatchNormalization": (IMG, lambda: L.BatchNormalization(), None),
    "LayerNormalization": (SEQ, lambda: L.LayerNormalization(), None),
    "GroupNormalization": (IMG, lambda: L.GroupNormalization(groups=3), None),
    "MultiHeadAttention": (SEQ, "attention", None),
    "PReLU": (SEQ, lambda: L.PReLU(), None),
    "LSTM(unroll=True)": (SEQ, lambda: L.LSTM(4, unroll=True), None),
    "GRU(unroll=True)": (SEQ, lambda: L.GRU(4, unroll=True), None),
    "Bidirectional(LSTM(unroll=True))": (SEQ, lambda: L.Bidirectional(L.LSTM(3, unroll=True)), None),
    "LSTM": (SEQ, lambda: L.LSTM(4), "TensorList"),
    "GRU": (SEQ, lambda: L.GRU(4), "TensorList"),
    "SimpleRNN": (SEQ, lambda: L.SimpleRNN(4), "TensorList"),
}


def build(shape, make):
    if shape == IDS:
        inputs = tf_keras.Input(shape, dtype="int32")
    else:
        inputs = tf_keras.Input(shape)
    if make == "attention":
        x = L.MultiHeadAttention(2, 4)(inputs, inputs)
    elif make == "mg_embedding":  # Model Garden's (BertEncoderV2's word embedding)
        from official.nlp.modeling.layers import OnDeviceEmbedding

        x = OnDeviceEmbedding(20, 4)(inputs)
    else:
        x = make()(inputs)
    return tf_keras.Model(inputs, L.Dense(3)(L.Flatten()(x)))


def test_common_layers_train_sharded_as_unsharded_or_are_refused_at_compile():
    mesh = tfpod.make_mesh("data:8")
    rng = np.random.RandomState(0)
    failures = []
    for name, (shape, make, refused_op) in LAYERS.items():
        tf_keras.backend.clear_session()
        x = rng.randint(0, 20, (32,) + shape).astype("int32") if shape == IDS else rng.randn(32, *shape).astype(
            "float32")
        y = rng.randint(0, 3, (32,)).astype("int32")
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        tf_keras.utils.set_random_seed(0)
        plain = build(shape, make)
        with tfpod.sharding(mesh):
            model = build(shape, make)
        model.set_weights(plain.get_weights())
        loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        plain.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss=loss)
        try:
            model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss=loss)
        except UserError as e:
            if refused_op is None or f"uses the op {refused_op}" not in str(e) or "\n" in str(e):
                failures.append(f"{name}: refused: {e}")
            continue
        if refused_op is not None:
            failures.append(f"{name}: compiled, but DTensor cannot lay out {refused_op}")
            continue
        got = model.fit(tfpod.input.to_mesh(train, mesh), epochs=2, verbose=0).history["loss"]
        want = plain.fit(train, epochs=2, verbose=0).history["loss"]
        if not np.allclose(got, want, rtol=1e-4, atol=1e-6):
            failures.append(f"{name}: losses {got} sharded vs {want}")
    assert not failures, failures
