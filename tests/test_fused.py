"""Fused kernels and hand-written gradients against the plain TensorFlow forms they replace."""

import numpy as np
import pytest
import tensorflow as tf

from tfpod import fused, optimizers
from tfpod.models import gpt, lm_head

pytestmark = pytest.mark.unit  # no subprocess, no multi-device training


@pytest.fixture(autouse=True, params=["0", "1"], ids=["plain", "xla"])
def xla_marks(request, monkeypatch):
    """Every test runs with the XLA marks off (the default) and on (TFPOD_XLA_FUSION=1)."""
    monkeypatch.setenv("TFPOD_XLA_FUSION", request.param)
    assert fused.enabled() == (request.param == "1")
    return request.param


def _value_and_grads(fn, *args):
    """fn(*args) and d sum(fn * w) / d args for a fixed random w, inside a tf.function."""

    @tf.function
    def run(*args):
        with tf.GradientTape() as tape:
            tape.watch(args)
            out = fn(*args)
            w = tf.random.stateless_normal(out.shape, seed=[7, 7], dtype=tf.float32)
            total = tf.reduce_sum(tf.cast(out, tf.float32) * w)
        return out, tape.gradient(total, args)

    out, grads = run(*args)
    return [out.numpy().astype(np.float32)] + [g.numpy().astype(np.float32) for g in grads]


@pytest.mark.parametrize("dtype,tol", [(tf.float32, 1e-5), (tf.bfloat16, 2e-2)])
def test_gelu_equals_tf_gelu_with_its_gradient(dtype, tol):
    x = tf.cast(tf.random.stateless_normal([64, 96], seed=[1, 2]) * 3.0, dtype)
    got = _value_and_grads(fused.gelu, x)
    want = _value_and_grads(lambda x: tf.nn.gelu(tf.cast(x, tf.float32)), x)  # exact GELU in float32
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(tf.float32, 1e-5), (tf.bfloat16, 2e-2)])
def test_rms_norm_and_swiglu_equal_autodiff_of_their_formulas(dtype, tol):
    """Llama's RMSNorm and SwiGLU, each with its own backward, against autodiff of the formula in float32."""
    x = tf.cast(tf.random.stateless_normal([4, 6, 32], seed=[5, 1]) * 2.0, dtype)
    scale = tf.random.stateless_normal([32], seed=[5, 2]) + 1.0
    rms = lambda x, g: tf.cast(x, tf.float32) * tf.math.rsqrt(
        tf.reduce_mean(tf.square(tf.cast(x, tf.float32)), -1, keepdims=True) + 1e-5) * g
    got = _value_and_grads(lambda x, g: fused.rms_norm(x, g, 1e-5), x, scale)
    want = _value_and_grads(rms, x, scale)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())
    up = tf.cast(tf.random.stateless_normal([4, 6, 32], seed=[5, 3]), dtype)
    got = _value_and_grads(fused.swiglu, x, up)
    want = _value_and_grads(lambda g, u: tf.nn.silu(tf.cast(g, tf.float32)) * tf.cast(u, tf.float32), x, up)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(tf.float32, 2e-5), (tf.bfloat16, 5e-2)])
def test_attention_equals_autodiff_of_the_softmax_form(dtype, tol, causal):
    """causal=True: the first half of the queries skips the second half of the keys."""
    b, h, l, d = 2, 3, 16, 8
    q, k, v = (tf.cast(tf.random.stateless_normal([b, h, l, d], seed=[3, i]), dtype) for i in range(3))
    # causal, two segments in the first row (as packing makes them), padding in the second
    segments = tf.constant([[1] * 6 + [2] * 10, [1] * 11 + [0] * 5])
    mask = gpt.causal_mask(tf.zeros([b, l], tf.int32), segments) * tf.cast(segments > 0, tf.float32)[:, None, :]
    bias = (1.0 - tf.cast(mask[:, None], dtype)) * tf.cast(-1e9, dtype)

    def reference(q, k, v):
        f = lambda t: tf.cast(t, tf.float32)
        scores = tf.matmul(f(q) * d ** -0.5, f(k), transpose_b=True) + f(bias)
        return tf.matmul(tf.nn.softmax(scores, axis=-1), f(v))

    got = _value_and_grads(lambda q, k, v: fused.attention(q, k, v, bias, causal=causal), q, k, v)
    want = _value_and_grads(reference, q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


# Machine epsilon: one rounding to the type (to nearest, or truncated as TensorFlow's Eigen
# bfloat16 MatMul does) changes a value by less than eps x |value|; U32 is float32's unit roundoff.
EPS = {tf.float32: 2.0 ** -23, tf.bfloat16: 2.0 ** -7}
U32 = 2.0 ** -24


def _cross_entropy_float64(logits, x, table, targets, weights):
    """The mean weighted cross entropy of given logits [tokens, vocab] in float64 and its
    gradients of x [tokens, embed] and table [vocab, embed] through logits = x @ table^T,
    each with the bound of its float32 / `dtype` rounding error (the error model below)
    as a function of (eps, U32): [(value, bound function)] for loss, loss_sum, weight_sum,
    d x, d table."""
    tokens, vocab = logits.shape
    top = logits.max(-1, keepdims=True)
    probs = np.exp(logits - top)
    probs /= probs.sum(-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(-1))  # [tokens]
    at_target = logits[np.arange(tokens), targets]
    token_loss = log_z - at_target
    weight_sum = weights.sum()
    loss_sum = (weights * token_loss).sum()
    scale = (weights / weight_sum)[:, None]  # [tokens, 1]: d loss / d token loss
    one_hot = np.eye(vocab)[targets]
    d_logits, d_logits_abs = (probs - one_hot) * scale, (probs + one_hot) * scale

    def loss_sum_bound(eps, u):
        per_token = (vocab + 8) * u + 2 * u * (np.abs(log_z) + np.abs(at_target))
        return (weights * per_token).sum() + tokens * u * (weights * np.abs(token_loss)).sum()

    grad_bound = lambda eps, u: 4 * eps + 2 * (vocab + tokens) * u
    return [(loss_sum / weight_sum, lambda eps, u: loss_sum_bound(eps, u) / weight_sum + u * loss_sum / weight_sum),
            (loss_sum, loss_sum_bound),
            (weight_sum, lambda eps, u: 0.0),  # a sum of zeros and ones: exact
            (d_logits @ table, lambda eps, u: grad_bound(eps, u) * d_logits_abs @ np.abs(table)),
            (d_logits.T @ x, lambda eps, u: grad_bound(eps, u) * d_logits_abs.T @ np.abs(x))]


@pytest.mark.parametrize("pool,strides,padding", [((2, 2), (2, 2), "VALID"), ((3, 3), (1, 1), "SAME"),
                                                  ((3, 2), (2, 1), "SAME"), ((3, 3), (2, 2), "valid")])
def test_avg_pool_equals_tensorflows_with_its_gradient(pool, strides, padding):
    """fused.avg_pool2d (a depthwise sum over a filter of ones, divided by the positions a
    window covers: with SAME padding fewer at the edges) against tf.nn.avg_pool2d, value
    and input gradient, in float64. Error model: both sum at most pool_h x pool_w terms
    (each output, and each input's gradient) and divide once, in another order: within
    (pool_h x pool_w + 1) 2^-53 of the largest term times the number of terms."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 7, 6, 3)))
    results = []
    for f in (fused.avg_pool2d, tf.nn.avg_pool2d):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x, pool, strides, padding.upper())
            w = tf.constant(np.random.default_rng(1).normal(size=y.shape))
            total = tf.reduce_sum(y * w)
        results.append((y.numpy(), tape.gradient(total, x).numpy(), w.numpy()))
    (y, dx, w), (want_y, want_dx, _) = results
    terms = pool[0] * pool[1]
    assert y.shape == want_y.shape and dx.shape == want_dx.shape
    np.testing.assert_allclose(y, want_y, rtol=0, atol=(terms + 1) * terms * 2.0 ** -53 * np.abs(x).max())
    np.testing.assert_allclose(dx, want_dx, rtol=0, atol=(terms + 1) * terms * 2.0 ** -53 * np.abs(w).max())
    assert np.abs(want_dx).max() > 0.1


@pytest.mark.parametrize("kernel,strides,padding,dilations,multiplier", [
    ((3, 3), (1, 1), "SAME", (1, 1), 1), ((3, 3), (2, 2), "SAME", (1, 1), 1), ((5, 5), (2, 2), "VALID", (1, 1), 2),
    ((3, 2), (2, 2), "SAME", (1, 1), 1), ((3, 3), (1, 1), "SAME", (2, 2), 1), ((2, 3), (3, 3), "VALID", (1, 1), 1)])
def test_depthwise_conv_gradients_equal_tensorflows(kernel, strides, padding, dilations, multiplier):
    """fused.depthwise_conv2d's input and filter gradients (stride phases, one product sum
    per tap) against TensorFlow's own kernels, in float64. Error model: each gradient value
    sums at most batch x out_h x out_w products (the filter's) or kh x kw x multiplier (the
    input's), in another order: within that many 2^-53 of the sum of their magnitudes."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(3, 9, 8, 4)))
    k = tf.constant(rng.normal(size=(*kernel, 4, multiplier)))
    results = []
    for f in (lambda x, k: fused.depthwise_conv2d(x, k, strides, padding, dilations),
              lambda x, k: tf.nn.depthwise_conv2d(x, k, [1, *strides, 1], padding, dilations=dilations)):
        with tf.GradientTape() as tape:
            tape.watch([x, k])
            y = f(x, k)
            w = tf.constant(np.random.default_rng(1).normal(size=y.shape))
            total = tf.reduce_sum(y * w)
        results.append([y.numpy()] + [g.numpy() for g in tape.gradient(total, [x, k])] + [w.numpy()])
    (y, dx, dk, w), (want_y, want_dx, want_dk, _) = results
    np.testing.assert_array_equal(y, want_y)
    terms = y.shape[0] * y.shape[1] * y.shape[2]
    np.testing.assert_allclose(dk, want_dk, rtol=0, atol=terms * 2.0 ** -52 * terms * np.abs(x).max() * np.abs(w).max())
    taps = kernel[0] * kernel[1] * multiplier
    np.testing.assert_allclose(dx, want_dx, rtol=0, atol=taps * 2.0 ** -52 * taps * np.abs(k).max() * np.abs(w).max())
    assert np.abs(want_dk).max() > 1.0 and np.abs(want_dx).max() > 0.5


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_output_layer_loss_equals_the_logits_loss_with_its_gradient(dtype):
    """lm_head.output_layer_loss (softmax once, one-hot terms as gathers) and the model's other
    path, loss_from_logits(GPT.output_logits(x)) by autodiff, each against float64:
    loss, loss_sum, weight_sum and the gradients of x and the table.

    Error model. Both forms compute the logits L = x @ table^T with one MatMul in `dtype` on
    the same inputs, so the same numbers; the reference is the float64 loss of those L.
    L's own rounding (float32 accumulation, one rounding to `dtype`: within eps |L| +
    embed U32 |x| |table| of exact, asserted) is common to both forms and to the model,
    not where they may differ. (Eigen's bfloat16 MatMul truncates: its logits lean toward
    zero, and this batch's loss is 15.8369 where float64 of the rounded inputs gives
    15.8752 and oneDNN's logits, rounded to nearest, 15.8726.) After L:
    - each token's loss is float32: exponentials (a few ulp each), a sum of vocab terms
      at most 1 with a total at least 1, a log, a subtraction: within (vocab + 8) U32 +
      2 U32 (|log_z| + |L_target|); the weighted sum over tokens adds tokens U32
      sum_t w_t |loss_t|; the mean one rounding more;
    - each gradient entry sums (probs - one_hot) * w / W times table rows (d x) or token
      rows (d table): probs float32 (relative (vocab + 2) U32), then at most 4 roundings
      in `dtype` (probs or d logits cast, the matmul's output, the scaling and the
      one-hot term's product and sum) and float32 accumulation over at most vocab +
      tokens terms: within (4 eps + 2 (vocab + tokens) U32) times the same sum over
      absolute values, sum_j (probs + one_hot) w / W |row_j|.
    """
    rng = np.random.default_rng(0)
    b, l, e, vocab = 2, 16, 32, 100
    x = tf.constant(rng.normal(size=(b, l, e)), tf.float32)
    table = tf.constant(rng.normal(size=(vocab, e)), tf.float32)
    batch = {"targets": tf.constant(rng.integers(0, vocab, size=(b, l)), tf.int32),
             "weights": tf.constant((rng.random((b, l)) > 0.3).astype(np.float32))}
    logits_of = lambda x, table: tf.matmul(tf.reshape(x, [-1, e]), table, transpose_b=True)  # as GPT.output_logits

    def fused_form(x, table):
        return lm_head.output_layer_loss(tf.cast(x, dtype), tf.cast(table, dtype), batch)

    def logits_form(x, table):
        logits = tf.reshape(logits_of(tf.cast(x, dtype), tf.cast(table, dtype)), [b, l, vocab])
        return lm_head.loss_from_logits(tf.cast(logits, tf.float32), batch)

    as64 = lambda t: tf.cast(t, tf.float64).numpy()
    x_in, table_in = as64(tf.cast(x, dtype)).reshape(-1, e), as64(tf.cast(table, dtype))  # the rounded inputs
    logits, exact = as64(logits_of(tf.cast(x, dtype), tf.cast(table, dtype))), x_in @ table_in.T
    assert (np.abs(logits - exact) <= EPS[dtype] * np.abs(exact) + e * U32 * np.abs(x_in) @ np.abs(table_in).T).all()
    reference = _cross_entropy_float64(logits, x_in, table_in, batch["targets"].numpy().reshape(-1),
                                       batch["weights"].numpy().reshape(-1).astype(np.float64))
    for form in (fused_form, logits_form):
        with tf.GradientTape() as tape:
            tape.watch([x, table])
            metrics = form(x, table)
            loss = metrics["loss_sum"] / tf.maximum(metrics["weight_sum"], 1.0)  # as the Trainer divides
        got = [loss, metrics["loss_sum"], metrics["weight_sum"]] + tape.gradient(loss, [x, table])
        for name, g, (want, bound) in zip(["loss", "loss_sum", "weight_sum", "d x", "d table"], got, reference):
            error = np.abs(g.numpy().astype(np.float64).reshape(np.shape(want)) - want)
            assert (error <= bound(EPS[dtype], U32)).all(), (form.__name__, name, error.max())


@pytest.mark.parametrize("precision,tol", [("float32", 2e-5), ("mixed_bfloat16", 3e-2)])
def test_batch_norm_equals_keras_unfused_batch_norm(precision, tol):
    """fused.BatchNormalization against Keras's unfused layer with the same weights: training
    output, the gradients of the input, gamma and beta, the moving averages after two
    steps, and the inference output."""
    import tf_keras

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(1.5, 2.0, size=(4, 5, 6, 8)).astype(np.float32))
    w = tf.constant(rng.normal(size=(4, 5, 6, 8)).astype(np.float32))
    results = []
    tf_keras.mixed_precision.set_global_policy(precision)
    try:
        for cls in (fused.BatchNormalization, tf_keras.layers.BatchNormalization):
            layer = cls(momentum=0.9, epsilon=1e-3, fused=False if cls is not fused.BatchNormalization else None,
                        name=f"bn_{len(results)}")
            layer.build(x.shape)
            layer.gamma.assign(np.linspace(0.5, 1.5, 8, dtype=np.float32))
            layer.beta.assign(np.linspace(-1.0, 1.0, 8, dtype=np.float32))

            @tf.function
            def train(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = layer(x, training=True)
                    total = tf.reduce_sum(tf.cast(y, tf.float32) * w)
                return [tf.cast(y, tf.float32)] + tape.gradient(total, [x, layer.gamma, layer.beta])

            out = [t.numpy() for t in train(x)]
            train(x * 0.5 + 1.0)
            out += [layer.moving_mean.numpy(), layer.moving_variance.numpy(),
                    tf.cast(layer(x, training=False), tf.float32).numpy()]
            assert (type(layer) is fused.BatchNormalization) == (len(results) == 0)
            results.append(out)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("mean", [100.0, 1000.0])
def test_batch_norm_float32_gradients_stay_near_float64_for_large_means(mean):
    """Channels whose mean is large against their spread (raw 0-255 pixels): the float32
    output and gradients stay as close to float64's (from the same float32 inputs) as
    autodiff of the same math on centered values, and closer than Keras's unfused form.
    (Computed as sum(dy * x) - mean * sum(dy) and x * c1 - mean * c1, d x was 4x and
    d gamma 4x further at mean 100.)"""
    eps = 1e-3
    rng = np.random.default_rng(1)
    x, w = (rng.normal(mean if i == 0 else 0.0, 1.0, size=(8, 12, 12, 8)).astype(np.float32) for i in range(2))
    gamma, beta = np.linspace(0.5, 1.5, 8, dtype=np.float32), np.linspace(-1, 1, 8, dtype=np.float32)

    def centered(x, g, b):
        xc = x - tf.reduce_mean(x, [0, 1, 2])
        return xc * g * tf.math.rsqrt(tf.reduce_mean(tf.square(xc), [0, 1, 2]) + eps) + b

    def keras_unfused(x, g, b):
        m, v = tf.nn.moments(x, [0, 1, 2])
        return tf.nn.batch_normalization(x, m, v, b, g, eps)

    def run(fn, dtype):
        @tf.function
        def step(x, g, b, w):
            with fused.scope():  # (every form's ops, forward and backward, marked for XLA when marks are on)
                with tf.GradientTape() as tape:
                    tape.watch([x, g, b])
                    y = fn(x, g, b)
                    total = tf.reduce_sum(y * w)
                return [y] + tape.gradient(total, [x, g, b])

        return [t.numpy().astype(np.float64) for t in step(*[tf.constant(a, dtype) for a in (x, gamma, beta, w)])]

    want = run(centered, tf.float64)
    error = lambda fn: [np.abs(g - r).max() / np.abs(r).max() for g, r in zip(run(fn, tf.float32), want)]
    ours = error(lambda x, g, b: fused.batch_norm(x, g, b, eps)[0])
    for name, other in [("centered autodiff", error(centered)), ("Keras unfused", error(keras_unfused))]:
        for what, e, bound in zip(["y", "d x", "d gamma", "d beta"], ours, other):
            assert e <= 1.5 * bound + 1e-7, (mean, name, what, e, bound)


def test_use_batch_norm_swaps_keras_batch_norm_layers(tmp_path):
    """The swap keeps each layer's weights and names; other layers are left alone; the
    model saves and loads in Keras's format."""
    import tf_keras

    inputs = tf_keras.Input([4, 4, 3])
    h = tf_keras.layers.Conv2D(8, 3, name="conv")(inputs)
    h = tf_keras.layers.BatchNormalization(name="bn")(h)
    model = tf_keras.Model(inputs, tf_keras.layers.ReLU()(h))
    names = [v.name for v in model.variables]
    fused.use_batch_norm(model)
    bns = [layer for layer in model.layers if "bn" in layer.name]
    assert [type(layer) for layer in bns] == [fused.BatchNormalization] and not bns[0].fused
    assert [v.name for v in model.variables] == names
    assert model(tf.ones([2, 4, 4, 3]), training=True).shape == (2, 2, 2, 8)
    model.save(tmp_path / "model.keras")
    loaded = tf_keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded.get_layer("bn")) is fused.BatchNormalization
    np.testing.assert_allclose(loaded.get_layer("bn").moving_mean.numpy(), bns[0].moving_mean.numpy())


@pytest.mark.parametrize("name", ["adamw", "lamb", "lars"])
def test_fused_optimizers_equal_model_gardens(name):
    """Four steps of the Fused* update (one XLA loop per weight) against Model Garden's own
    class, weight decay on the kernel and off for the bias, warmup and decay in the rate."""
    cfg = optimizers.OptimizerConfig(name=name, learning_rate=1e-2, warmup_steps=2, decay_steps=10, weight_decay=0.1)
    results = []
    for fused_update in (True, False):
        opt = optimizers.build_optimizer(cfg, 10, fused_update=fused_update)
        if not fused_update and name == "adamw":
            opt.gradient_clip_norm = 0.0  # the trainer clips; tfpod's AdamW does not clip again
        rng = np.random.default_rng(0)
        variables = [tf.Variable(rng.normal(size=(16, 8)).astype(np.float32), name="dense/kernel"),
                     tf.Variable(rng.normal(size=(8,)).astype(np.float32), name="dense/bias")]
        grads = [[tf.constant(rng.normal(size=v.shape).astype(np.float32)) for v in variables] for _ in range(4)]
        step = tf.function(lambda g: [opt.apply_gradients(zip(g, variables))] and None)
        for g in grads:
            step(g)
        assert type(opt).__name__.startswith("Fused") == fused_update
        results.append([v.numpy() for v in variables] + [s.numpy() for s in optimizers.slot_variables(opt)])
    assert len(results[0]) == len(results[1]) > 2
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
