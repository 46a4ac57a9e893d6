"""Keras 3's layers under keras.distribution on TensorFlow (tfpod/keras3/ops.py): one model
holding every layer docs/keras.md lists as training, fit under ModelParallel on
data:4,model:2 (kernels, an embedding table and attention heads split over `model`) and
without a distribution; and the one-line refusal of a layer DTensor cannot lay out.

Tolerances as tests/test_keras3.py (float32; the runs differ by the order of sums): 2e-5
relative, 2e-6 absolute on losses and weights, 1e-4 absolute on predictions (up-sampled
activations of size ~30 carry ~5e-6 of rounding).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpod  # noqa: F401  (backs keras.distribution once keras is imported)

keras = pytest.importorskip("keras")
from tfpod import UserError  # noqa: E402

L = keras.layers


pytestmark = pytest.mark.usefixtures("no_keras3_distribution")


def _branches():
    """[(input, output)] of small branches, one per family of layers; names are layout-map keys."""
    image = keras.Input((8, 8, 4))
    x = L.Rescaling(0.5)(image)
    x = L.Conv2D(8, 3, padding="same", name="conv_out")(x)          # kernel split on output channels
    x = L.BatchNormalization()(x)
    x = L.Conv2D(8, 3, padding="same", name="conv_in")(x)           # kernel split on input channels
    x = L.DepthwiseConv2D(3, strides=2, depth_multiplier=2, padding="same")(x)
    x = L.SeparableConv2D(8, 3, padding="same")(x)
    x = L.Conv2D(8, 3, groups=2, padding="same")(x)
    x = L.GroupNormalization(2)(x)
    x = L.SpatialDropout2D(0.3)(x)
    x = L.AveragePooling2D(3, strides=2, padding="same")(x)
    x = L.UpSampling2D()(x)
    x = L.ZeroPadding2D()(x)
    x = L.Conv2DTranspose(4, 3, strides=2, name="deconv")(x)        # kernel split
    x = L.MaxPooling2D()(x)
    x = L.Resizing(4, 4)(x)
    image_out = L.GlobalAveragePooling2D()(x)

    volume = keras.Input((4, 4, 4, 2))
    v = L.Conv3D(4, 1)(volume)
    volume_out = L.Flatten()(L.AveragePooling3D(2)(v))

    tokens = keras.Input((6,), dtype="int32")
    t = L.Embedding(16, 8, name="embed")(tokens)                    # table split by rows
    t = L.MultiHeadAttention(2, 4, name="mha")(t, t)                # heads split
    t = L.LayerNormalization()(t)
    t = L.Conv1D(8, 3, padding="same", name="conv1d")(t)
    t = L.DepthwiseConv1D(3, padding="same")(t)
    t = L.SeparableConv1D(8, 3, padding="same")(t)
    t = L.AveragePooling1D(2)(t)
    t = L.LSTM(4, return_sequences=True, unroll=True)(t)
    t = L.Bidirectional(L.GRU(3, unroll=True))(t)
    tokens_out = t

    def block(h, dim, name):  # ConvNeXt's: grouped 7x7 convolution, two Dense layers, a residual sum
        r = L.LayerNormalization()(L.Conv2D(dim, 7, padding="same", groups=dim, name=f"{name}_dw")(h))
        r = L.Dense(dim, name=f"{name}_pw2")(L.Dense(4 * dim, activation="gelu", name=f"{name}_pw1")(r))
        return L.Add()([h, r])

    stages = keras.Input((8, 8, 3))
    s = block(L.Conv2D(16, 2, strides=2)(stages), 16, "b0")  # b0_pw2 split: the sum is split over model
    s = block(L.Conv2D(32, 2, strides=2)(L.LayerNormalization()(s)), 32, "b1")
    stages_out = L.GlobalAveragePooling2D()(s)

    features = keras.Input((6,))
    f = L.Normalization(mean=0.5, variance=2.0)(features)
    f = L.EinsumDense("ab,bc->ac", output_shape=8, name="einsum")(f)
    f = L.PReLU()(f)
    f = L.RMSNormalization()(f)
    f = L.GaussianNoise(0.1)(f)
    f = L.Dropout(0.2)(f)
    features_out = L.UnitNormalization()(f)
    return [image, volume, tokens, features, stages], [image_out, volume_out, tokens_out, features_out, stages_out]


def _model():
    inputs, outputs = _branches()
    joined = L.Concatenate()(outputs)
    return keras.Model(inputs, L.Dense(3, name="head")(joined))


def _data():
    rng = np.random.RandomState(0)
    x = [rng.normal(size=(16, 8, 8, 4)), rng.normal(size=(16, 4, 4, 4, 2)), rng.randint(0, 16, size=(16, 6)),
         rng.normal(size=(16, 6)), rng.normal(size=(16, 8, 8, 3))]
    x = [a.astype("int32" if a.dtype.kind == "i" else "float32") for a in x]
    return x, rng.normal(size=(16, 3)).astype("float32")


def _fit():
    keras.utils.set_random_seed(5)
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    x, y = _data()
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    return model, history["loss"], model.predict(x, verbose=0, batch_size=8), model.get_weights()


def test_every_listed_layer_trains_split_with_one_devices_losses():
    _, plain_loss, plain_pred, plain_weights = _fit()
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"], keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in {"conv_out/kernel": (None, None, None, "model"), "conv_in/kernel": (None, None, "model", None),
                      "deconv/kernel": (None, None, "model", None), "embed/embeddings": ("model", None),
                      "mha/(query|key|value)/kernel": (None, "model", None),
                      "mha/attention_output/kernel": ("model", None, None), "conv1d/kernel": (None, None, "model"),
                      "einsum/kernel": (None, "model"), "b0_pw2/kernel": (None, "model")}.items():
        layout_map[key] = axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    model, loss, pred, weights = _fit()
    np.testing.assert_allclose(loss, plain_loss, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(pred, plain_pred, rtol=0, atol=1e-4)
    for a, b in zip(weights, plain_weights):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    table = model.get_layer("embed").embeddings
    assert dtensor.fetch_layout(table.value).sharding_specs == ["model", dtensor.UNSHARDED]


def test_a_layer_dtensor_cannot_lay_out_is_named_in_one_line():
    """An LSTM without unroll=True (a while loop over TensorLists) stops the first step with
    one line naming the layer and the fix."""
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    inputs = keras.Input((5, 4))
    model = keras.Model(inputs, L.Dense(1)(L.LSTM(3, name="recurrent")(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(UserError, match=r"layer 'recurrent' \(LSTM\) uses the op \w+, which DTensor cannot lay out "
                                        r"\(keras.distribution on TensorFlow\): .*unroll=True"):
        model.fit(tf.zeros((8, 5, 4)), tf.zeros((8, 1)), verbose=0)


def test_a_step_that_fails_while_running_raises_instead_of_logging_zeros():
    """A step that fails on the devices (here a NaN caught by tf.debugging.check_numerics) leaves
    its outputs holding the error and nothing raises by itself: fit would log losses of 0.0 for
    steps that changed nothing. The next step, or the end of the epoch, raises it. (In a process of
    its own: a failed DTensor step leaves the runtime unusable.)"""
    import subprocess
    import sys

    from conftest import ROOT

    script = """
import numpy as np, tensorflow as tf, tfpod, keras
class Checked(keras.layers.Layer):
    def call(self, x):
        return tf.debugging.check_numerics(x, "the input has a NaN")
keras.distribution.initialize()
keras.distribution.set_distribution(keras.distribution.DataParallel())
inputs = keras.Input((4,))
model = keras.Model(inputs, keras.layers.Dense(1)(Checked()(inputs)))
model.compile(optimizer="sgd", loss="mse")
x = np.ones((16, 4), "float32")
x[3, 1] = np.nan
try:
    print("TRAINED", model.fit(x, np.zeros((16, 1)), batch_size=8, epochs=1, verbose=0).history)
except tf.errors.OpError as e:
    print("RAISED", type(e).__name__)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "TFPOD_CPU_DEVICES": "8"})
    assert "RAISED" in out.stdout and "TRAINED" not in out.stdout, (out.stdout + out.stderr)[-2000:]
