"""Which common tf_keras layers train sharded (docs/keras.md's table).

Each layer sits in a small functional model (input -> layer -> flatten -> dense; average
pooling after a 1x1 convolution, so that its gradient runs) built
under `tfpod.sharding` on data:8 and fit on batch-sharded data; a layer that trains must
give the losses of the same model fit unsharded from the same weights, and one that
cannot must be refused at compile with one line naming the op.
"""

import contextlib

import numpy as np
import tensorflow as tf
import tf_keras

from conftest import device_mesh

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
    "Conv2D(groups=3)": (IMG, lambda: L.Conv2D(3, 3, padding="same", groups=3), None),  # ConvNeXt's, depthwise
    "Conv2D(groups=3, 6 filters)": (IMG, lambda: L.Conv2D(6, 3, strides=2, groups=3), None),
    "Conv2DTranspose": (IMG, lambda: L.Conv2DTranspose(4, 3, strides=2, padding="same"), None),
    "DepthwiseConv2D": (IMG, lambda: L.DepthwiseConv2D(3, strides=2, padding="same"), None),
    "SeparableConv2D": (IMG, lambda: L.SeparableConv2D(4, 3, padding="same"), None),
    "DepthwiseConv1D": (SEQ, lambda: L.DepthwiseConv1D(3, padding="same"), None),
    "SeparableConv1D": (SEQ, lambda: L.SeparableConv1D(4, 3, padding="same"), None),
    "MaxPooling2D": (IMG, lambda: L.MaxPooling2D(), None),
    "AveragePooling2D": (IMG, "conv_then_avg_pool", None),  # after a layer with weights: its gradient runs
    "AveragePooling2D(3, strides=1, same)": (IMG, "conv_then_overlapping_avg_pool", None),
    "AveragePooling1D": (SEQ, "conv_then_avg_pool_1d", None),
    "AveragePooling3D": (VOL, "conv_then_avg_pool_3d", "AvgPool3DGrad"),
    "GlobalMaxPooling2D": (IMG, lambda: L.GlobalMaxPooling2D(), None),
    "UpSampling2D": (IMG, lambda: L.UpSampling2D(interpolation="bilinear"), None),
    "ZeroPadding2D": (IMG, lambda: L.ZeroPadding2D(), None),
    "BatchNormalization": (IMG, lambda: L.BatchNormalization(), None),
    "LayerNormalization": (SEQ, lambda: L.LayerNormalization(), None),
    "Normalization": (IMG, lambda: L.Normalization(), None),  # EfficientNet's first layer
    "Normalization(mean, variance)": (IMG, lambda: L.Normalization(mean=[.4, .5, .6], variance=[.2, .3, .4]), None),
    "Rescaling": (IMG, lambda: L.Rescaling(1 / 255.0, offset=-0.5), None),
    "Resizing": (IMG, lambda: L.Resizing(6, 6), None),
    "CenterCrop": (IMG, lambda: L.CenterCrop(6, 6), None),
    "Sequential in a functional model": (IMG, "nested_sequential", None),  # ConvNeXt's stem
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


def layer_output(shape, make, inputs):
    if make == "attention":
        return L.MultiHeadAttention(2, 4)(inputs, inputs)
    if isinstance(make, str) and make.startswith("conv_then_"):  # AvgPool's gradient runs only after a layer with weights
        pool = {"conv_then_avg_pool": lambda: L.AveragePooling2D(),
                "conv_then_overlapping_avg_pool": lambda: L.AveragePooling2D(3, strides=1, padding="same"),
                "conv_then_avg_pool_1d": lambda: L.AveragePooling1D(2),
                "conv_then_avg_pool_3d": lambda: L.AveragePooling3D(2)}[make]()
        conv = {SEQ: L.Conv1D, IMG: L.Conv2D, VOL: L.Conv3D}[shape](4, 1)
        return pool(conv(inputs))
    if make == "nested_sequential":  # built by the functional model around it, as ConvNeXt's stem
        return tf_keras.Sequential([L.Conv2D(4, 2, strides=2), L.LayerNormalization(epsilon=1e-6)])(inputs)
    if make == "mg_embedding":  # Model Garden's (BertEncoderV2's word embedding)
        from official.nlp.modeling.layers import OnDeviceEmbedding

        return OnDeviceEmbedding(20, 4)(inputs)
    return make()(inputs)


def build(layers: dict):
    """One functional model with a branch per layer (input -> layer -> flatten -> dense(3)),
    each branch an output with its own loss: the branches share nothing, so each layer
    trains as it would alone."""
    inputs, logits = [], []
    for i, (shape, make, _) in enumerate(layers.values()):
        inputs.append(tf_keras.Input(shape, dtype="int32" if shape == IDS else "float32", name=f"in{i}"))
        logits.append(L.Dense(3, name=f"head{i}")(L.Flatten()(layer_output(shape, make, inputs[-1]))))
    return tf_keras.Model(inputs, logits)


def data(layers: dict, rng) -> tf.data.Dataset:
    x = {f"in{i}": rng.randint(0, 20, (32,) + shape).astype("int32") if shape == IDS else
         rng.randn(32, *shape).astype("float32") for i, (shape, _, _) in enumerate(layers.values())}
    y = rng.randint(0, 3, (32,)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, {f"head{i}": y for i in range(len(layers))})).batch(16)


def fit_both(layers: dict, mesh, rng):
    """The model of `layers` built plainly and under tfpod.sharding from the same weights,
    both compiled with SGD; the sharded compile may raise UserError."""
    tf_keras.backend.clear_session()
    tf_keras.utils.set_random_seed(0)
    plain = build(layers)
    with tfpod.sharding(mesh):
        model = build(layers)
    model.set_weights(plain.get_weights())
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss=loss, run_eagerly=True)  # no trace of the reference
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss=loss)
    return plain, model


def test_common_layers_train_sharded_as_unsharded_or_are_refused_at_compile():
    """The layers that train sit in one model (one compile instead of one per layer), each
    in its own branch with its own loss: each branch's losses over 2 epochs match unsharded
    ones, and so do its weights after them. On data:2 (2 of the 8 devices: each its half of
    the batch; 8 devices compiled the same program 4 times over)."""
    mesh = device_mesh("data:2")
    rng = np.random.RandomState(0)
    trains = {name: spec for name, spec in LAYERS.items() if spec[2] is None}
    train = data(trains, rng)
    plain, model = fit_both(trains, mesh, rng)
    got = model.fit(tfpod.input.to_mesh(train, mesh), epochs=2, verbose=0).history
    want = plain.fit(train, epochs=2, verbose=0).history
    failures = []
    sharded = dict(zip((layer.name for layer in plain.layers), model.layers))  # the same graph, built twice
    for i, name in enumerate(trains):
        key = f"head{i}_loss" if len(trains) > 1 else "loss"
        if not np.allclose(got[key], want[key], rtol=1e-4, atol=1e-6):
            failures.append(f"{name}: losses {got[key]} sharded vs {want[key]}")
        for layer_name in sorted(branch_layers(plain, i)):
            for w, v in zip(plain.get_layer(layer_name).weights, sharded[layer_name].weights):
                if not np.allclose(tfpod_value(v), w.numpy(), rtol=1e-4, atol=1e-6):
                    failures.append(f"{name}: {w.name} differs from unsharded by "
                                    f"{np.abs(tfpod_value(v) - w.numpy()).max():.3g}")
    for name, spec in LAYERS.items():
        if spec[2] is None:
            continue
        try:
            fit_both({name: spec}, mesh, rng)
        except UserError as e:
            if f"uses the op {spec[2]}" not in str(e) or "\n" in str(e):
                failures.append(f"{name}: refused: {e}")
            continue
        failures.append(f"{name}: compiled, but DTensor cannot lay out {spec[2]}")
    assert not failures, failures


def branch_layers(model, i: int) -> set[str]:
    """Names of the layers between input `in{i}` and its head (the layer, flatten, head)."""
    names, frontier = set(), [model.get_layer(f"in{i}")]
    while frontier:
        layer = frontier.pop()
        for node in layer.outbound_nodes:
            nxt = node.outbound_layer
            if nxt.name in names:
                continue
            names.add(nxt.name)
            frontier.append(nxt)
    return names


def tfpod_value(v) -> np.ndarray:
    """A (possibly sharded) variable's whole value on the host."""
    from tensorflow.experimental import dtensor

    value = v.read_value()
    if not dtensor.is_dtensor(value):
        return value.numpy()
    layout = dtensor.fetch_layout(value)
    return dtensor.unpack(dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank)))[0].numpy()


# Preprocessing layers that cannot train on the mesh: (input shape, dtype, layer, a batch of input)
HOST_ONLY = {
    "RandomFlip": ((8, 8, 3), "float32", lambda: L.RandomFlip("horizontal")),
    "RandomRotation": ((8, 8, 3), "float32", lambda: L.RandomRotation(0.1)),
    "StringLookup": ((4,), "string", lambda: L.StringLookup(vocabulary=["a", "b", "c"])),
    "IntegerLookup": ((4,), "int64", lambda: L.IntegerLookup(vocabulary=[1, 2, 3])),
    "TextVectorization": ((1,), "string", lambda: L.TextVectorization(max_tokens=6, output_sequence_length=4,
                                                                       vocabulary=["a", "b", "c"])),
    "Discretization": ((4,), "float32", lambda: L.Discretization(bin_boundaries=[-1.0, 0.0, 1.0])),
    "CategoryEncoding": ((4,), "int32", lambda: L.CategoryEncoding(num_tokens=5, output_mode="multi_hot")),
    "Hashing (of integers)": ((4,), "int32", lambda: L.Hashing(num_bins=5)),  # found by its op, AsString
}


def host_batch(shape, dtype, rng):
    if dtype == "string":
        words = rng.choice(list("abcd"), (8,) + shape)
        return np.array([[" ".join(row)] for row in words]) if shape == (1,) else words
    if dtype.startswith("int"):
        return rng.randint(0, 5, (8,) + shape).astype(dtype)
    return rng.randn(8, *shape).astype(dtype)


def test_preprocessing_that_cannot_run_on_the_mesh_is_refused_at_compile_with_the_dataset_map_line_that_works():
    """Lookups, encodings and random augmentation are refused at compile in one line naming the
    layer; the line's code (the layer re-made, then dataset.map) runs as given and yields what the
    layer yields."""
    mesh = device_mesh("data:2")
    rng = np.random.RandomState(0)
    failures = []
    for name, (shape, dtype, make) in HOST_ONLY.items():
        tf_keras.backend.clear_session()
        with tfpod.sharding(mesh):
            inputs = tf_keras.Input(shape, dtype=dtype)
            hidden = L.Flatten()(tf.cast(make()(inputs), "float32"))
            model = tf_keras.Model(inputs, L.Dense(3)(hidden))
        try:
            model.compile(optimizer="sgd", loss="mse")
        except UserError as e:
            message = str(e)
        else:
            failures.append(f"{name}: compiled")
            continue
        layer = model.layers[1]
        if f"layer {layer.name!r} ({type(layer).__name__})" not in message or "\n" in message:
            failures.append(f"{name}: {message}")
            continue
        code = message.split("`")[1]  # preprocess = ...; dataset = dataset.map(...)
        x = host_batch(shape, dtype, rng)
        scope = {"tf": tf, "tf_keras": tf_keras,
                 "dataset": tf.data.Dataset.from_tensor_slices((x, np.zeros(8, "float32"))).batch(4)}
        exec(code, scope)  # the line as the user would paste it
        got = np.concatenate([batch.numpy() for batch, _ in scope["dataset"]])
        if got.shape[0] != 8 or (not name.startswith("Random") and not np.array_equal(got, make()(x).numpy())):
            failures.append(f"{name}: the mapped dataset gives {got.shape} {got[:1]}")
    assert not failures, failures


def test_an_augmentation_sequential_is_moved_whole_and_the_model_on_its_output_trains():
    """Keras's data-augmentation pattern (a Sequential of Random* layers inside the model) is refused
    naming the Sequential to move, with Rescaling after it; the model built on the mapped dataset trains."""
    mesh = device_mesh("data:2")
    augment = lambda: tf_keras.Sequential([L.RandomFlip("horizontal"), L.RandomRotation(0.1)],  # noqa: E731
                                          name="data_augmentation")
    tf_keras.backend.clear_session()
    with tfpod.sharding(mesh):
        inputs = tf_keras.Input((8, 8, 3))
        hidden = L.Conv2D(4, 3)(L.Rescaling(1 / 255.0)(augment()(inputs)))
        model = tf_keras.Model(inputs, L.Dense(3)(L.Flatten()(hidden)))
    try:
        model.compile(optimizer="sgd", loss="mse")
        raise AssertionError("compiled")
    except UserError as e:
        message = str(e)
    assert "in 'data_augmentation'" in message and "tf_keras.Sequential([tf_keras.Sequential([" in message, message
    assert "tf_keras.layers.Rescaling(scale=0.00392" in message, message
    rng = np.random.RandomState(0)
    scope = {"tf": tf, "tf_keras": tf_keras, "dataset": tf.data.Dataset.from_tensor_slices(
        (rng.rand(16, 8, 8, 3).astype("float32") * 255, rng.randn(16, 3).astype("float32"))).batch(8)}
    exec(message.split("`")[1], scope)
    with tfpod.sharding(mesh):
        inputs = tf_keras.Input((8, 8, 3))
        model = tf_keras.Model(inputs, L.Dense(3)(L.Flatten()(L.Conv2D(4, 3)(inputs))))
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(tfpod.input.to_mesh(scope["dataset"], mesh), epochs=1, verbose=0).history
    assert np.isfinite(history["loss"][0]), history


def test_a_normalization_adapted_in_the_scope_or_after_building_trains_as_unsharded_and_one_adapted_outside_is_refused():
    """Keras's adapt on a Normalization made under tfpod.sharding, before the model is built (lazy
    variables) or after (on the mesh), gives the statistics and losses of plain Keras; a layer made
    and adapted outside the scope is refused at compile in one line, and its fix trains."""
    mesh = device_mesh("data:2")
    rng = np.random.RandomState(0)
    x, y = (rng.randn(32, 5) * 3 + 2).astype("float32"), rng.randn(32, 2).astype("float32")
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)

    def fit(norm, sharded: bool):
        tf_keras.utils.set_random_seed(0)
        with tfpod.sharding(mesh) if sharded else contextlib.nullcontext():
            inputs = tf_keras.Input((5,))
            model = tf_keras.Model(inputs, L.Dense(2)(norm()(inputs)))
        model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss="mse", run_eagerly=not sharded)
        return model.fit(tfpod.input.to_mesh(train, mesh) if sharded else train, epochs=2, verbose=0).history["loss"]

    def adapted(data):
        layer = L.Normalization()
        layer.adapt(data)
        return layer

    want = fit(lambda: adapted(x), sharded=False)
    before = fit(lambda: adapted(train.map(lambda a, b: a)), sharded=True)  # a dataset, in the scope
    with tfpod.sharding(mesh):  # compile inside the scope: refused in one line
        try:
            fit(lambda: adapted(x), sharded=True)
            raise AssertionError("compiled inside the scope")
        except UserError as e:
            assert "compile called inside `with tfpod.sharding(...)`" in str(e), e
    layers = []
    with tfpod.sharding(mesh):
        tf_keras.utils.set_random_seed(0)
        inputs = tf_keras.Input((5,))
        layers.append(L.Normalization())
        model = tf_keras.Model(inputs, L.Dense(2)(layers[0](inputs)))
    layers[0].adapt(x)  # after the model is built, outside the scope: its variables are on the mesh
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss="mse")
    after = model.fit(tfpod.input.to_mesh(train, mesh), epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(before, want, rtol=1e-5)
    np.testing.assert_allclose(after, want, rtol=1e-5)

    outside = adapted(x)
    with tfpod.sharding(mesh):
        inputs = tf_keras.Input((5,))
        model = tf_keras.Model(inputs, L.Dense(2)(outside(inputs)))
    try:
        model.compile(optimizer="sgd", loss="mse")
        raise AssertionError("compiled")
    except UserError as e:
        assert f"layer {outside.name!r} (Normalization)" in str(e) and "mean=adapted.mean.numpy()" in str(e), e
    fixed = fit(lambda: L.Normalization(mean=outside.mean.numpy(), variance=outside.variance.numpy()), True)
    np.testing.assert_allclose(fixed, want, rtol=1e-5)
