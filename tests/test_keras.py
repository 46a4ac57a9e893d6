"""Keras users' models trained sharded with model.fit (tfpod.keras) on 8 logical CPU devices.

Every sharded run is compared with the same tf_keras model fit unsharded (no mesh,
one device) from the same initial weights on the same batches: per-epoch losses,
evaluate and predict must agree (relative 1e-4), and the variables must really be
split (their DTensor layouts).
"""

import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from conftest import device_mesh

import tfpod
from tfpod import UserError, compat
from tfpod import fused, keras as tk
from tfpod.keras import support

BATCH, FEATURES, CLASSES = 32, 16, 4

# Megatron-style MLP: the first kernel split by columns, the second by rows (one
# all-reduce); logical axes through the `tensor` preset (mlp -> model).
FUNCTIONAL_RULES = {
    r"hidden\.kernel": ("embed", "mlp"),
    r"hidden\.bias": ("mlp",),
    r"project\.kernel": ("mlp", "embed"),
}
# The same with mesh axes named directly, for a subclassed model's object paths.
SUBCLASSED_RULES = [
    (r"blocks\.\d+\.up\.kernel", (None, "model")),
    (r"blocks\.\d+\.up\.bias", ("model",)),
    (r"blocks\.\d+\.down\.kernel", ("model", None)),
]


def data(n=128, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, FEATURES).astype("float32")
    y = (x[:, :CLASSES] + 0.3 * rng.randn(n, CLASSES)).argmax(-1).astype("int32")
    return x, y


def batches(x, y, batch=BATCH, **kwargs):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, **kwargs)


def functional():
    inputs = tf_keras.Input((FEATURES,))
    x = tf_keras.layers.BatchNormalization(momentum=0.5, name="bn")(inputs)  # on the mesh: over the global batch
    h = tf_keras.layers.Dense(64, activation="relu", name="hidden")(x)
    h = tf_keras.layers.Dense(FEATURES, name="project")(h)
    h = tf_keras.layers.LayerNormalization(name="norm")(h + x)
    return tf_keras.Model(inputs, tf_keras.layers.Dense(CLASSES, name="head")(h))


class Block(tf_keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = tf_keras.layers.Dense(32, activation="gelu")
        self.down = tf_keras.layers.Dense(FEATURES)

    def call(self, x):
        return x + self.down(self.up(x))


class Subclassed(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.blocks = [Block() for _ in range(2)]
        self.head = tf_keras.layers.Dense(CLASSES)

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def compile_(model, optimizer="adam", steps_per_execution=1, metrics=("accuracy",), plain=False):
    """Compiles with the tests' loss; a `plain` (unsharded reference) model runs eagerly: the same
    train step op by op, without tracing it (a third of a test's time went to the reference's trace)."""
    model.compile(optimizer=optimizer, steps_per_execution=steps_per_execution, metrics=list(metrics),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=plain)


def assert_close(a, b, rtol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6)


def specs(model):
    return {v.name.split(":")[0]: tuple(tk.layout_of(v).sharding_specs) for v in model.weights}


@pytest.fixture(scope="module")
def mesh42():
    return tfpod.make_mesh("data:4,model:2")


def test_functional_fit_evaluate_predict_match_unsharded(mesh42):
    x, y = data()
    vx, vy = data(64, seed=1)
    tf_keras.utils.set_random_seed(0)
    with tfpod.sharding(mesh42, rules=FUNCTIONAL_RULES) as placed:
        model = functional()
    layouts = specs(model)
    assert layouts["hidden/kernel"] == (dtensor.UNSHARDED, "model")
    assert layouts["hidden/bias"] == ("model",)
    assert layouts["project/kernel"] == ("model", dtensor.UNSHARDED)
    assert layouts["head/kernel"] == (dtensor.UNSHARDED, dtensor.UNSHARDED)  # no rule: replicated
    assert "replicated (no rule): 9 of 12 variables" in placed.report()

    tf_keras.utils.set_random_seed(0)
    plain = functional()
    # Same seed, same initial values: they are computed replicated, then split.
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)

    compile_(model, "adam", steps_per_execution=4)  # one host call per epoch of 4 steps
    compile_(plain, "adam", plain=True)
    assert type(model.get_layer("bn")) is fused.BatchNormalization  # DTensor cannot run the fused kernel
    train, val = batches(x, y, drop_remainder=True), batches(vx, vy, drop_remainder=True)
    sharded = model.fit(tk.to_mesh(train, mesh42), epochs=2, verbose=0)
    reference = plain.fit(train, epochs=2, verbose=0)
    for key in ("loss", "accuracy"):
        assert_close(sharded.history[key], reference.history[key])
    # Optimizer state lives beside its weight: Adam's moments split like the kernels.
    slots = {v.name: tuple(tk.layout_of(v).sharding_specs) for v in model.optimizer.variables}
    assert slots["Adam/m/hidden/kernel:0"] == (dtensor.UNSHARDED, "model")
    assert_close(model.evaluate(tk.to_mesh(val, mesh42), verbose=0), plain.evaluate(val, verbose=0))
    predicted = model.predict(tk.to_mesh(val, mesh42), verbose=0)
    assert predicted.shape == (64, CLASSES)
    assert_close(predicted, plain.predict(val, verbose=0))
    one = model.predict(tk.to_mesh(val.take(1), mesh42), verbose=0)  # one batch: Keras joins nothing
    assert_close(one, predicted[:len(one)])


def test_checkpoint_resume_early_stopping_and_tensorboard(mesh42, tmp_path):
    x, y = data()
    train = batches(x, y, drop_remainder=True)  # 4 steps per epoch

    def sharded_model():
        tf_keras.utils.set_random_seed(0)
        with tfpod.sharding(mesh42, rules=FUNCTIONAL_RULES):
            model = functional()
        compile_(model, tf_keras.optimizers.Adam(1e-3))  # an instance: re-created on the mesh
        return model

    tf_keras.utils.set_random_seed(0)
    plain = functional()
    compile_(plain, tf_keras.optimizers.Adam(1e-3), plain=True)
    uninterrupted = plain.fit(train, epochs=4, verbose=0).history["loss"]

    model_dir = str(tmp_path / "run")
    first = sharded_model().fit(
        tk.to_mesh(train, mesh42), epochs=2, verbose=0,
        callbacks=[tk.Checkpoint(model_dir, keep=2), tf_keras.callbacks.TensorBoard(str(tmp_path / "tb"), write_graph=False)],
    )
    assert_close(first.history["loss"], uninterrupted[:2])
    checkpoints = os.path.join(model_dir, "checkpoints")
    assert sorted(f for f in os.listdir(checkpoints) if f.endswith(".index")) == ["ckpt-4.index", "ckpt-8.index"]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb" / "train"))

    # A new process's model (fresh initial weights) resumes at step 8 = epoch 2 of 4.
    resumed_model = sharded_model()
    callback = tk.Checkpoint(model_dir, keep=2)
    resumed = resumed_model.fit(tk.to_mesh(train, mesh42), epochs=4, verbose=0, callbacks=[callback])
    assert callback.restored_step == 8
    assert_close(resumed.history["loss"], uninterrupted[2:])
    assert sorted(f for f in os.listdir(checkpoints) if f.endswith(".index")) == ["ckpt-12.index", "ckpt-16.index"]

    # EarlyStopping, restoring the best (here: the first) epoch's weights into the sharded variables.
    stop = tf_keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1, restore_best_weights=True)
    seen = []
    grab = tf_keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(resumed_model.get_weights()))
    stopped = resumed_model.fit(tk.to_mesh(train, mesh42), epochs=20, verbose=0, callbacks=[grab, stop])
    assert len(stopped.history["loss"]) == 2 and stop.stopped_epoch == 1
    final = resumed_model.get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(final, seen[0]))
    assert not all(np.array_equal(a, b) for a, b in zip(final, seen[1]))
    assert tuple(tk.layout_of(resumed_model.get_layer("hidden").kernel).sharding_specs) == (dtensor.UNSHARDED, "model")

    # model.save writes the unsharded copy (Keras's classes, the split kernel gathered) in each format.
    want = resumed_model.predict(tk.to_mesh(train, mesh42), verbose=0)
    for name in ("saved_model", "model.keras", "model.h5"):
        resumed_model.save(str(tmp_path / name))
        loaded = tf_keras.models.load_model(str(tmp_path / name))
        assert all(type(layer).__module__.startswith("tf_keras.") for layer in loaded.layers), name
        assert_close(loaded.predict(train, verbose=0), want)
    served = tf.saved_model.load(str(tmp_path / "saved_model")).signatures["serving_default"]
    assert_close(list(served(tf.constant(x[:BATCH])).values())[0], want[:BATCH])
    assert type(resumed_model.get_layer("bn")).__module__.startswith("tfpod.")  # the stand-ins stay in the model


def test_subclassed_fit_matches_unsharded_with_legacy_optimizer(tmp_path):
    mesh = tfpod.make_mesh("data:2,model:4")
    x, y = data()
    with tfpod.sharding(mesh, rules=SUBCLASSED_RULES):
        model = Subclassed()
        model.build((None, FEATURES))
    layouts = specs(model)
    assert layouts["subclassed/block/dense/kernel"] == (dtensor.UNSHARDED, "model")
    assert layouts["subclassed/block_1/dense_3/kernel"] == ("model", dtensor.UNSHARDED)
    plain = Subclassed()
    plain(tf.zeros((1, FEATURES)))
    # A subclassed model's variables are placed in object-path order, not creation
    # order, so the seed draws differ: start both from the same weights.
    plain.set_weights(model.get_weights())
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    # A legacy optimizer (as tf-models-official's are) gets its slots as DVariables; a
    # metric object is re-created with its state on the mesh.
    top2 = lambda: tf_keras.metrics.SparseTopKCategoricalAccuracy(2, name="top2")
    compile_(model, tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9), metrics=["accuracy", top2()])
    compile_(plain, tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9), metrics=["accuracy", top2()],
             plain=True)
    train, val = batches(x, y, drop_remainder=True), batches(*data(64, seed=1), drop_remainder=True)
    sharded = model.fit(tk.to_mesh(train, mesh), validation_data=tk.to_mesh(val, mesh), epochs=2, verbose=0)
    reference = plain.fit(train, validation_data=val, epochs=2, verbose=0)
    for key in ("loss", "accuracy", "top2", "val_loss", "val_accuracy", "val_top2"):
        assert_close(sharded.history[key], reference.history[key])
    assert_close(model.predict(tk.to_mesh(train, mesh), verbose=0), plain.predict(train, verbose=0))
    momentum = model.optimizer.get_slot(model.blocks[0].up.kernel, "momentum")
    assert tuple(tk.layout_of(momentum).sharding_specs) == (dtensor.UNSHARDED, "model")
    model.save(str(tmp_path / "saved_model"))  # the unsharded copy, built on the shapes it was built on
    served = tf.saved_model.load(str(tmp_path / "saved_model")).signatures["serving_default"]
    assert_close(list(served(tf.constant(x[:BATCH])).values())[0], plain.predict(x[:BATCH], verbose=0))


@pytest.mark.unit
def test_to_mesh_rows_partial_batches_and_errors(mesh42):
    x = np.arange(100 * 3, dtype="float32").reshape(100, 3)
    y = np.arange(100, dtype="int32")
    ds = tk.to_mesh(batches(x, y), mesh42)  # 3 full batches of 32, then 4 rows: dropped
    got = [(dtensor.fetch_layout(bx).sharding_specs, tk.get_values([by])[0]) for bx, by in ds]
    assert [g[1][0] for g in got] == [0, 32, 64] and all(len(g[1]) == 32 for g in got)
    assert got[0][0] == ["data", dtensor.UNSHARDED]
    # Each data shard holds 8 consecutive rows of the global batch (both model devices alike).
    bx, _ = next(iter(ds))
    shards = [s.numpy() for s in dtensor.unpack(bx)]
    np.testing.assert_array_equal(shards[2], x[8:16])  # device 2 = data 1, model 0
    np.testing.assert_array_equal(shards[3], x[8:16])  # device 3 = data 1, model 1
    assert tk.to_mesh(batches(x, y, drop_remainder=True), mesh42).cardinality().numpy() == 3
    with pytest.raises(UserError, match=r"global_batch_size=30 does not divide over mesh axis 'data' of size 4"):
        tk.to_mesh(batches(x, y, batch=30, drop_remainder=True), mesh42)
    with pytest.raises(UserError, match=r"batch_axis='batch' is not an axis of the mesh \(data, model\)"):
        tk.to_mesh(batches(x, y), mesh42, batch_axis="batch")


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


@pytest.mark.unit
def test_bad_rules_stop_with_one_line(mesh42):
    def build(rules, **kwargs):
        with tfpod.sharding(mesh42, rules=rules, **kwargs):
            model = functional()
        compile_(model)
        return model

    build({r"head\.kernel": (None, "model")})  # 4 classes split over model:2; over model:8 they do not divide
    mesh = tfpod.make_mesh("model:8")
    with pytest.raises(UserError) as e:
        with tfpod.sharding(mesh, rules={r"head\.kernel": (None, "model")}):
            functional()
    assert one_line(e) == (
        "variable head.kernel (16, 4): dimension 1 (model, size 4) does not divide over mesh axis 'model' of size 8 "
        "(rule 'head\\\\.kernel'): change the model size, the mesh, or map 'model' to no mesh axis in sharding.rules"
    )
    with pytest.raises(UserError) as e:
        tfpod.sharding(mesh42, rules={r"hidden\.kernel": ("embed", "modle")})
    assert "unknown axis 'modle'" in one_line(e) and "(data, model)" in one_line(e)
    with pytest.raises(UserError) as e:
        tfpod.sharding(mesh42, rules={}, attention="materialized")
    assert one_line(e).startswith("tfpod.sharding: attention is a str, not a tfpod.attention.AttentionConfig")
    with pytest.raises(UserError) as e:
        build({r"hidden\.kernel": ("embed",)})
    assert "has rank 2 but rule" in one_line(e)
    with pytest.raises(UserError) as e:
        build({r"hidden\.kernel": ("embed", "mlp"), r".*kernel": (None, None)})
    assert "is matched by two sharding rules" in one_line(e)
    with pytest.raises(UserError) as e:
        build({r"dense\.kernel": (None, "mlp")})
    assert one_line(e).startswith("sharding rule 'dense\\\\.kernel' (None, 'mlp') matches no variable")
    with pytest.raises(UserError) as e:
        build(FUNCTIONAL_RULES, cover_all=True)
    assert "matches no sharding rule" in one_line(e)


# -- layers whose kernels DTensor cannot lay out ------------------------------------------


def text_model():
    from official.nlp.modeling.layers import OnDeviceEmbedding

    ids = tf_keras.Input((12,), dtype="int32")
    x = tf_keras.layers.Embedding(48, 8, name="embed")(ids) + OnDeviceEmbedding(48, 8, name="mg_embed")(ids)
    x = tf_keras.layers.SeparableConv1D(8, 3, padding="causal", name="sep1d")(x)
    x = tf_keras.layers.DepthwiseConv1D(3, padding="same", depth_multiplier=2, name="dw1d")(x)
    x = tf_keras.layers.GlobalAveragePooling1D()(x)
    return tf_keras.Model(ids, tf_keras.layers.Dense(CLASSES, name="head")(x))


def image_model():
    images = tf_keras.Input((9, 9, 3))
    x = tf_keras.layers.Conv2D(4, 3, padding="same", name="conv")(images)
    x = tf_keras.layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2, activation="relu",
                                        name="dw2d")(x)
    x = tf_keras.layers.SeparableConv2D(6, 3, dilation_rate=2, padding="same", name="sep2d")(x)
    x = tf_keras.layers.GlobalAveragePooling2D()(x)
    return tf_keras.Model(images, tf_keras.layers.Dense(CLASSES, name="head")(x))


@pytest.mark.parametrize("kind", ["text", "image"])
def test_embeddings_and_depthwise_convolutions_train_like_unsharded(mesh42, kind):
    """Embedding (its table's rows split over `model`: a one-hot matmul; its sparse gradient
    made dense), DepthwiseConv1D/2D and SeparableConv1D/2D (strides, dilation, causal
    padding; tfpod.fused.depthwise_conv2d's gradient) train on data:4,model:2 as unsharded,
    with a new and a legacy optimizer."""
    rng = np.random.RandomState(0)
    build, x = ((text_model, rng.randint(0, 48, (64, 12)).astype("int32")) if kind == "text" else
                (image_model, rng.randn(64, 9, 9, 3).astype("float32")))
    y = rng.randint(0, CLASSES, (64,)).astype("int32")
    rules = {r"(mg_)?embed\.embeddings": ("vocab", "embed")} if kind == "text" else None
    optimizer = (lambda: tf_keras.optimizers.Adam(1e-2)) if kind == "text" else (
        lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9))
    tf_keras.utils.set_random_seed(0)
    plain = build()
    with tfpod.sharding(mesh42, rules=rules):
        model = build()
    model.set_weights(plain.get_weights())
    compile_(plain, optimizer(), plain=True)
    compile_(model, optimizer())
    swapped = {layer.name: type(layer).__module__ for layer in model.layers}
    assert all(swapped[n] == "tfpod.keras.layers" for n in swapped if n in ("sep1d", "dw1d", "dw2d", "sep2d"))
    if kind == "text":
        assert specs(model)["embed/embeddings"] == specs(model)["mg_embed/embeddings"] == ("model", dtensor.UNSHARDED)
        assert swapped["embed"] == "tfpod.keras.layers"  # OneHotEmbedding: DTensor's gather needs whole rows
        assert model.get_layer("mg_embed")._use_one_hot  # Model Garden's own one-hot mode
    train = batches(x, y, batch=16, drop_remainder=True)
    sharded = model.fit(tk.to_mesh(train, mesh42), epochs=3, verbose=0).history
    reference = plain.fit(train, epochs=3, verbose=0).history
    assert_close(sharded["loss"], reference["loss"])
    assert_close(model.predict(tk.to_mesh(train, mesh42), verbose=0), plain.predict(train, verbose=0))


def test_mobilenet_v2_trains_sharded():
    """tf_keras.applications.MobileNetV2 (depthwise convolutions, batch norm, ReLU6) on data:2
    (2 of the 8 devices: each image's half of the batch on its own device, batch norm's
    statistics over both; 8 devices compiled 4 times the programs for the same check):
    the first step's loss and the weights after it equal plain Keras's, both in float64.

    Why float64: one step of this model is discontinuous at ReLU6's kinks. In float32 a
    pre-activation within rounding of 0 (this batch has one 6e-7 from it) lands on either
    side by chance, and the side decides about 1% of the update: float64 Keras with its
    inputs and weights perturbed by 2^-24 moved by 0.9% of the largest update; float32
    steps landed 0.7% to 1.4% from float64 Keras's (Keras's with oneDNN and on Eigen
    kernels, tfpod's on Eigen, by initial weights) where they are otherwise within 1e-4
    (1.2e-5 to 8.2e-5). Float64's rounding is 2^29 times finer than that closest value.
    Error model: a weight's gradient is a sum over at most n = 16 images x 16 x 16
    positions (the first layers), within n 2^-53 of its terms' summed magnitudes (about the
    update's size); twice that for the error carried back from the layers above: 2 n 2^-53
    = 9.1e-13 of the largest update (measured: 4.0e-14, on oneDNN and on Eigen kernels)."""
    mesh = device_mesh("data:2")
    build = lambda: tf_keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=5, alpha=0.35)
    rng = np.random.RandomState(0)
    x, y = rng.randn(16, 32, 32, 3), rng.randint(0, 5, (16,)).astype("int32")
    tf_keras.utils.set_random_seed(0)
    # float64 layers: floatx alone is not enough once any test (or tfpod's trainer) has set a
    # global policy, which then wins over floatx; both are put back after.
    policy = tf_keras.mixed_precision.global_policy()
    tf_keras.backend.set_floatx("float64")
    tf_keras.mixed_precision.set_global_policy("float64")
    try:
        plain = build()
        with tfpod.sharding(mesh):
            model = build()
    finally:
        tf_keras.mixed_precision.set_global_policy(policy)
        tf_keras.backend.set_floatx("float32")
    assert {w.dtype for m in (plain, model) for w in m.get_weights()} == {np.dtype(np.float64)}
    start = plain.get_weights()
    model.set_weights(start)
    for m in (plain, model):
        m.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss=tf_keras.losses.SparseCategoricalCrossentropy(),
                  run_eagerly=m is plain)  # the reference op by op: no trace of it
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    sharded = model.fit(tk.to_mesh(train, mesh), epochs=1, verbose=0).history["loss"]
    reference = plain.fit(train, epochs=1, verbose=0).history["loss"]
    # Keras logs the loss through a float32 Mean metric: the sharded side sums the devices' float32
    # shares, then both divide total by count; each rounding is within 2^-24 relative, and 32
    # of them bound the two paths (a suite run measured 6.9e-7 = 11.6 x 2^-24 on Eigen kernels).
    assert_close(sharded, reference, rtol=32 * 2.0 ** -24)
    after, expected = model.get_weights(), plain.get_weights()
    assert {a.dtype for a in after} == {e.dtype for e in expected} == {np.dtype(np.float64)}
    largest = max(np.abs(e - s).max() for e, s in zip(expected, start))
    assert largest > 0.1
    n = 16 * 16 * 16  # the deepest reduction: images x positions of the first layers
    assert max(np.abs(a - e).max() for a, e in zip(after, expected)) < 2 * n * 2.0 ** -53 * largest


class DilatedConv(tf_keras.layers.Layer):
    """A user's layer calling tf.nn.conv2d with dilations 2, or (by_zeros) with the kernel dilated by zeros."""

    def __init__(self, by_zeros=False, **kwargs):
        super().__init__(**kwargs)
        self.by_zeros = by_zeros

    def build(self, shape):
        self.kernel = self.add_weight("kernel", [3, 3, shape[-1], 2])

    def call(self, x):
        if self.by_zeros:
            return tf.nn.conv2d(x, fused.dilate(self.kernel, 2, 2), 1, "SAME")
        return tf.nn.conv2d(x, self.kernel, 1, "SAME", dilations=2)


def test_a_dilated_conv2d_gradient_on_eigen_kernels_is_one_line_at_compile(mesh42):
    """TensorFlow's CPU kernels run tf.nn.conv2d's gradient dilated only with oneDNN. The
    compile-time trace finds the dilated gradient kernels (on either path, asked for Eigen's
    gaps); on Eigen kernels (TF_ENABLE_ONEDNN_OPTS=0, or a CPU without AVX-512) compile
    stops with one line naming the layer and the fix, with oneDNN the layer trains; the fix
    (the kernel dilated by zeros) trains on both, with the same losses where both run."""
    images = np.random.RandomState(0).randn(32, 8, 8, 3).astype("float32")
    labels = np.random.RandomState(1).randint(0, CLASSES, 32).astype("int32")

    def model(by_zeros):
        tf_keras.utils.set_random_seed(0)
        with tfpod.sharding(mesh42):
            inputs = tf_keras.Input((8, 8, 3))
            h = DilatedConv(by_zeros, name="dilated")(tf_keras.layers.Conv2D(3, 1, name="pointwise")(inputs))
            return tf_keras.Model(inputs, tf_keras.layers.Dense(CLASSES)(tf_keras.layers.Flatten()(h)))

    def fit(m):
        compile_(m)
        return m.fit(tk.to_mesh(batches(images, labels), mesh42), epochs=1, verbose=0).history["loss"]

    dilated, by_zeros = model(False), model(True)
    trace = lambda m: support._trace(m, support.input_spec(m))
    assert {op for op, _ in support.unsupported_ops(trace(dilated), eigen=True)} == {
        "Conv2DBackpropInput", "Conv2DBackpropFilter"}
    assert support.unsupported_ops(trace(dilated)) == support.unsupported_ops(trace(by_zeros), eigen=True) == []
    fixed = fit(by_zeros)
    assert np.isfinite(fixed).all()
    if compat.onednn_enabled():
        assert_close(fit(dilated), fixed, rtol=1e-5)
    else:
        with pytest.raises(UserError) as e:
            compile_(dilated)
        message = one_line(e)
        assert message.startswith("model 'model")
        assert "layer 'dilated' (DilatedConv) uses the op Conv2DBackprop" in message
        assert "TF_ENABLE_ONEDNN_OPTS=0" in message and "tfpod.fused.dilate" in message


class Recurrent(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.gru = tf_keras.layers.GRU(4, name="gru")
        self.head = tf_keras.layers.Dense(CLASSES)

    def call(self, x):
        return self.head(self.gru(x))


def test_unsupported_ops_are_found_at_compile(mesh42):
    """A layer whose train step DTensor cannot lay out stops compile with one line naming it
    and what to do (a trace, nothing run); built as the line says, it trains."""
    seq = np.random.RandomState(0).randn(32, 6, 5).astype("float32")
    labels = np.zeros(32, "int32")

    def recurrent(**kwargs):
        inputs = tf_keras.Input((6, 5))
        out = tf_keras.layers.Bidirectional(tf_keras.layers.LSTM(4, **kwargs), name="bilstm")(inputs)
        return tf_keras.Model(inputs, tf_keras.layers.Dense(CLASSES)(out))

    with tfpod.sharding(mesh42):
        model = recurrent()
    with pytest.raises(UserError) as e:
        compile_(model)
    assert one_line(e).startswith("model 'model") and "layer 'bilstm' (Bidirectional) uses the op TensorList" in str(
        e.value) and "unroll=True" in str(e.value)
    with tfpod.sharding(mesh42):
        model = recurrent(unroll=True)
    compile_(model)
    loss = model.fit(tk.to_mesh(batches(seq, labels), mesh42), epochs=1, verbose=0).history["loss"]
    assert np.isfinite(loss).all()

    with tfpod.sharding(mesh42):
        model = Recurrent()
        model(seq[:2])  # a subclassed model: its first call's inputs give the traced spec
    with pytest.raises(UserError) as e:
        compile_(model)
    assert "layer 'gru' (GRU) uses the op TensorList" in one_line(e)

    with tfpod.sharding(mesh42):
        inputs = tf_keras.Input((6, 5))
        flipped = tf_keras.layers.Lambda(lambda t: tf.reverse(t, [1]), name="flip")(inputs)
        model = tf_keras.Model(inputs, tf_keras.layers.Dense(CLASSES)(tf_keras.layers.Flatten()(flipped)))
    with pytest.raises(UserError) as e:
        compile_(model)
    assert "layer 'flip' (Lambda) uses the op ReverseV2" in one_line(e) and "tf.gather" in str(e.value)

    # An op the table does not list fails when the step compiles: one line naming it.
    x = dtensor.copy_to_mesh(tf.ones([8, 4]), dtensor.Layout.replicated(mesh42, 2))
    with pytest.raises(tf.errors.OpError) as raw:
        tf.function(lambda t: tf.reverse(t, [1]))(dtensor.relayout(x, dtensor.Layout(["data", "unsharded"], mesh42)))
    assert str(support.translate(raw.value, "m")).startswith("model 'm': the op ReverseV2 in its train step")


class Tracked(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = tf_keras.layers.Dense(3)
        self.tracker = tf_keras.metrics.Mean(name="loss_tracker")

    def call(self, x):
        return self.dense(x)


@pytest.mark.unit
def test_weights_keep_their_order_and_unused_mesh_axes_are_refused():
    mesh = tfpod.make_mesh("data:8")
    plain = Tracked()
    plain(np.ones((8, 5), "float32"))
    with tfpod.sharding(mesh):
        model = Tracked()
        model(np.ones((8, 5), "float32"))
    # A metric's [total, count] (tf_keras re-created them in path order: [count, total]).
    assert [w.name.split("/")[-1] for w in model.weights] == [w.name.split("/")[-1] for w in plain.weights]
    values = [np.full(w.shape, i + 1.0, "float32") for i, w in enumerate(plain.weights)]
    model.set_weights(values)
    plain.set_weights(model.get_weights())
    assert float(plain.tracker.result()) == 3.0 / 4.0  # total 3 / count 4: not swapped

    with pytest.raises(UserError) as e:
        tfpod.sharding(tfpod.make_mesh("data:4,modle:2"))
    assert one_line(e).startswith("mesh axis 'modle' (size 2) is used by no rule of preset 'tensor' (its mesh axes: "
                                  "'data', 'expert', 'model')")
    tfpod.sharding(tfpod.make_mesh("data:4,modle:2"), rules={r"dense\.kernel": (None, "modle")})  # named in a rule


@pytest.mark.unit
def test_presets_the_keras_front_end_cannot_honour_are_refused():
    """A Keras model's layers do not split image rows (`model` would only repeat work), and
    Keras's optimizer keeps each slot laid out like its weight (weight_update's sharded
    update would be silently dropped)."""
    with pytest.raises(UserError) as e:
        tfpod.sharding(tfpod.make_mesh("data:2,model:4"), preset="spatial")
    assert "a Keras model's layers do not split image rows" in one_line(e)
    tfpod.sharding(tfpod.make_mesh("data:8"), preset="spatial")  # no axis for the rows: the data preset's work
    with pytest.raises(UserError) as e:
        tfpod.sharding(tfpod.make_mesh("data:8"), preset="weight_update")
    assert "preset 'weight_update' shards the optimizer update over 'data', which the Keras front end does not" \
        in one_line(e)
