"""Fused kernels: hand-written gradients that take fewer passes over memory than
autodiff's, and (opt-in) XLA fusion of their elementwise chains inside the op-by-op step.

On a CPU (and a GPU) TensorFlow runs a step op by op, each elementwise op one pass over
its tensor, so a transformer step spends much of its time outside the matmuls. The
gradients here (GELU, attention) recompute or reuse what they can and
skip autodiff's intermediate passes; the optimizer updates in `tfpod.optimizers` are
written the same way.

XLA, opt-in: `TFPOD_XLA_FUSION=1` in the environment marks each elementwise chain with
`tf.xla.experimental.jit_scope`, and those clusters survive DTensor's SPMD expansion (a
nested `tf.function(jit_compile=True)` is inlined by it; compiling the whole DTensor
step ran XLA's CPU dot slower than oneDNN). It is off unless asked for: long test
processes that built many meshes and programs crashed with the marks on (segfaults in
the DTensor runtime). Measurements: docs/benchmarks.md.

Everything here computes the same function as the plain TensorFlow form (tests compare
values and gradients, with the marks on and off).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import tensorflow as tf
import tf_keras

from tfpod import compat

_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def enabled() -> bool:
    """Whether ops are marked for XLA clustering (env TFPOD_XLA_FUSION=1; off by default)."""
    return os.environ.get("TFPOD_XLA_FUSION", "0") == "1"


def scope():
    """Marks the ops created inside for one XLA cluster (a no-op eagerly or when disabled)."""
    if tf.executing_eagerly() or not enabled():
        return contextlib.nullcontext()
    return tf.xla.experimental.jit_scope(separate_compiled_gradients=False)


@tf.autograph.experimental.do_not_convert
@tf.custom_gradient
def gelu(x: tf.Tensor):
    """Exact GELU, x * Phi(x), computed in float32 whatever x's dtype (as tf.nn.gelu).

    The backward recomputes Phi(x) instead of keeping it (d/dx = Phi(x) + x * phi(x));
    with XLA marks, forward and backward are each one loop.
    """
    normal_cdf = lambda xf: 0.5 * tf.math.erfc(xf * -_SQRT_HALF)  # Phi(x), float32
    with scope():
        xf = tf.cast(x, tf.float32)
        y = tf.cast(xf * normal_cdf(xf), x.dtype)

    def grad(dy):
        with scope():
            xf = tf.cast(x, tf.float32)
            pdf = tf.exp(-0.5 * xf * xf) * _INV_SQRT_2PI
            return tf.cast(tf.cast(dy, tf.float32) * (normal_cdf(xf) + xf * pdf), x.dtype)

    return y, grad


def rms_norm(x: tf.Tensor, scale: tf.Tensor, epsilon: float) -> tf.Tensor:
    """x * rsqrt(mean(x^2) + epsilon) * scale over the last axis (Llama's RMSNorm), computed in
    float32 and returned in x's dtype, with a backward in two passes over x instead of
    autodiff's five: d x = r * (dx^ - x^ * mean(dx^ * x^)), dx^ = dy * scale, d scale = sum(dy * x^).
    """
    axes = list(range(len(x.shape) - 1))

    @tf.custom_gradient
    def core(x, scale):
        with scope():
            xf = tf.cast(x, tf.float32)
            r = tf.math.rsqrt(tf.reduce_mean(tf.square(xf), -1, keepdims=True) + epsilon)
            normed = xf * r
            y = tf.cast(normed * tf.cast(scale, tf.float32), x.dtype)

        def grad(dy):
            with scope():
                dyf = tf.cast(dy, tf.float32)
                d_normed = dyf * tf.cast(scale, tf.float32)
                dx = r * (d_normed - normed * tf.reduce_mean(d_normed * normed, -1, keepdims=True))
                return tf.cast(dx, x.dtype), tf.cast(tf.reduce_sum(dyf * normed, axes), scale.dtype)

        return y, grad

    return core(x, scale)


@tf.custom_gradient
def swiglu(gate: tf.Tensor, up: tf.Tensor):
    """silu(gate) * up (Llama's MLP), computed in float32 whatever the inputs' dtype.

    tf.nn.silu's own gradient captures its beta, which DTensor's lowering refuses inside
    the train loop ("operand #0 does not dominate this use"); here the backward
    recomputes the sigmoid: d gate = dy * up * s * (1 + gate * (1 - s)), d up = dy * silu(gate).
    """
    with scope():
        gf, uf = tf.cast(gate, tf.float32), tf.cast(up, tf.float32)
        y = tf.cast(gf * tf.sigmoid(gf) * uf, gate.dtype)

    def grad(dy):
        with scope():
            gf, uf, dyf = tf.cast(gate, tf.float32), tf.cast(up, tf.float32), tf.cast(dy, tf.float32)
            s = tf.sigmoid(gf)
            return (tf.cast(dyf * uf * s * (1.0 + gf * (1.0 - s)), gate.dtype),
                    tf.cast(dyf * gf * s, up.dtype))

    return y, grad


def activation(name):
    """A Keras activation by name, with "gelu" (exact) as the fused `gelu` and
    "gelu_approximate" the tanh form (GPT-2's gelu_new)."""
    if name == "gelu":
        return gelu
    if name == "gelu_approximate":
        return lambda x: tf_keras.activations.gelu(x, approximate=True)
    return tf_keras.activations.get(name)


def attention(q: tf.Tensor, k: tf.Tensor, v: tf.Tensor, bias: tf.Tensor, causal: bool = False) -> tf.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v, with a gradient in fewer passes than autodiff's.

    Args:
      q, k, v: [batch, heads, length, d] (the compute dtype).
      bias: additive mask [batch, 1 or heads, length, length] in q's dtype (0 where a
        query may attend, -1e9 where not).
      causal: the mask never lets a query attend a later key (it may mask more, e.g.
        other segments). The first half of the queries then skips the second half of
        the keys, a quarter of the scores that are all masked: 3/4 of the score
        matmuls and softmax passes. A query of the first half
        that may attend no key at all (padding) then averages the first half's values,
        not all of them; such rows carry no loss weight and no later query reads them.

    Returns:
      [batch, heads, length, d].

    The backward uses o and do instead of the [length, length] probabilities for the
    softmax's row sums (FlashAttention's D = rowsum(do * o) = rowsum(dp * p)), so the
    score gradient p * (dp - D) is one fused pass where autodiff takes four.
    """
    length = q.shape[2]
    if not causal or length is None or length != k.shape[2] or length % 2:
        return _attention(q, k, v, bias)
    half = length // 2
    early = _attention(q[:, :, :half], k[:, :, :half], v[:, :, :half], bias[:, :, :half, :half])
    late = _attention(q[:, :, half:], k, v, bias[:, :, half:])
    return tf.concat([early, late], axis=2)


def _attention(q: tf.Tensor, k: tf.Tensor, v: tf.Tensor, bias: tf.Tensor) -> tf.Tensor:
    """`attention` over all keys: q [b, h, lq, d], k and v [b, h, lk, d], bias [b, 1|h, lq, lk]."""
    scale = tf.cast(q.shape[-1] ** -0.5, q.dtype)

    @tf.autograph.experimental.do_not_convert
    @tf.custom_gradient
    def core(q, k, v):
        probs = tf.nn.softmax(tf.matmul(q * scale, k, transpose_b=True) + bias, axis=-1)  # [b, h, l, l]
        out = tf.matmul(probs, v)

        def grad(d_out):
            d_v = tf.matmul(probs, d_out, transpose_a=True)
            d_probs = tf.matmul(d_out, v, transpose_b=True)  # [b, h, l, l]
            row = tf.reduce_sum(tf.cast(d_out, tf.float32) * tf.cast(out, tf.float32), axis=-1, keepdims=True)
            with scope():
                d_scores = tf.cast(tf.cast(probs, tf.float32) * (tf.cast(d_probs, tf.float32) - row), q.dtype)
            d_q = tf.matmul(d_scores, k) * scale
            d_k = tf.matmul(d_scores, q, transpose_a=True) * scale
            return d_q, d_k, d_v

        return out, grad

    return core(q, k, v)


def batch_norm(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor, epsilon: float):
    """Training-mode batch normalization over every axis but the last, with its own gradient.

    The math of Keras's unfused BatchNormalization (in float32, float64 for float64 x; the
    biased batch variance): y = (x - mean) * gamma / sqrt(variance + epsilon) + beta.
    TensorFlow's fused kernel (FusedBatchNormV3) has no DTensor layout propagation, and
    autodiff of the unfused form takes about twice the passes over x of this backward:

      d beta = sum(dy), d gamma = sum(dy * xc) * inv,
      d x = dy * a + xc * c1 + c0, with xc = x - mean, a = gamma * inv and per-channel c1, c0.

    Forward and backward work on the centered values xc (kept for the backward in place of
    x): where a channel's mean is large against its spread, sum(dy * x) - mean * sum(dy) and
    x * c1 - mean * c1 cancel in float32, and the gradients then drift from float64's.

    Under DTensor a batch-sharded x's sums are reduced over the mesh (synchronized batch
    norm over the global batch).

    Args:
      x: [..., channels] (any float dtype).
      gamma, beta: [channels] float32 (float64 for float64 x).
      epsilon: added to the variance.

    Returns:
      (y in x's dtype, mean, variance [channels] in the statistics' dtype). The statistics
      are for the moving averages: no gradient flows back through them.
    """
    axes = list(range(len(x.shape) - 1))
    stats = tf.float64 if x.dtype == tf.float64 else tf.float32

    @tf.autograph.experimental.do_not_convert
    @tf.custom_gradient
    def core(x, gamma, beta):
        with scope():
            mean = tf.reduce_mean(tf.cast(x, stats), axes)
            xc = tf.cast(x, stats) - mean  # centered: no cancellation below, forward or backward
            variance = tf.reduce_mean(tf.square(xc), axes)
            inv = tf.math.rsqrt(variance + epsilon)
            a = gamma * inv
            y = tf.cast(xc * a + beta, x.dtype)

        def grad(dy, *_):  # the statistics' gradients: none (they only feed the moving averages)
            with scope():
                dyf = tf.cast(dy, stats)
                n = tf.cast(tf.size(dyf) // tf.shape(dyf)[-1], stats)
                sum_dy = tf.reduce_sum(dyf, axes)
                sum_dy_xc = tf.reduce_sum(dyf * xc, axes)
                c1 = -a * inv * inv * sum_dy_xc / n
                c0 = -a * sum_dy / n
                dx = tf.cast(dyf * a + (xc * c1 + c0), x.dtype)
            return dx, sum_dy_xc * inv, sum_dy

        return (y, mean, variance), grad

    return core(x, gamma, beta)


@tf_keras.saving.register_keras_serializable(package="tfpod")
class BatchNormalization(tf_keras.layers.BatchNormalization):
    """Keras's BatchNormalization (same weights, moving averages and inference path) whose
    training step is `batch_norm`: what DTensor can run in place of the fused kernel.

    Configurations `batch_norm` does not cover (renorm, virtual batches, masks, a
    channel axis other than the last, a training flag that is a tensor) take Keras's
    unfused path.
    """

    def call(self, inputs, training=None, mask=None):
        training = compat.training_value(self, training)
        plain = (training is not True or mask is not None or self.renorm or self.virtual_batch_size is not None
                 or self.adjustment is not None or self.gamma is None or self.beta is None
                 or list(self.axis) != [len(inputs.shape) - 1])
        if plain:
            return super().call(inputs, training=training, mask=mask)
        y, mean, variance = batch_norm(tf.cast(inputs, self.compute_dtype), self.gamma, self.beta, self.epsilon)
        self.add_update(lambda: compat.assign_moving_average(self, self.moving_mean, mean, self.momentum))
        self.add_update(lambda: compat.assign_moving_average(self, self.moving_variance, variance, self.momentum))
        return y


def use_batch_norm(model: tf_keras.layers.Layer) -> None:
    """Makes every Keras BatchNormalization layer inside `model` (that class itself, not
    subclasses such as SyncBatchNormalization) a `BatchNormalization` (FusedBatchNormV3
    has no DTensor layout propagation). Weights, names and checkpoints are unchanged;
    call it before the train step is traced."""
    for layer in compat.flatten_layers(model):
        if type(layer) is tf_keras.layers.BatchNormalization:
            layer.fused = False
            layer.__class__ = BatchNormalization


def conv_geometry(size: int, kernel: int, stride: int, dilation: int, padding: str) -> tuple[int, int, int]:
    """(output size, padding before, padded input size) of one spatial dimension, as TensorFlow pads."""
    extent = (kernel - 1) * dilation + 1
    if padding == "VALID":
        return (size - extent) // stride + 1, 0, size
    out = -(-size // stride)
    total = max((out - 1) * stride + extent - size, 0)
    return out, total // 2, size + total


def dilate(kernel: tf.Tensor, dh: int, dw: int) -> tf.Tensor:
    """[kh, kw, c, m] -> [(kh-1)*dh+1, (kw-1)*dw+1, c, m] with zeros between the taps.

    An undilated convolution with it makes the dilated one's products (and adds zeros):
    what runs on every CPU kernel path, where TensorFlow's Eigen kernels (no oneDNN)
    have no gradient of tf.nn.conv2d with dilations > 1."""
    if dh == dw == 1:
        return kernel
    kh, kw, c, m = kernel.shape
    k = tf.pad(tf.reshape(kernel, [kh, 1, kw, 1, c, m]), [[0, 0], [0, dh - 1], [0, 0], [0, dw - 1], [0, 0], [0, 0]])
    return tf.reshape(k, [kh * dh, kw * dw, c, m])[: (kh - 1) * dh + 1, : (kw - 1) * dw + 1]


def depthwise_conv2d(x: tf.Tensor, kernel: tf.Tensor, strides=(1, 1), padding: str = "SAME",
                     dilations=(1, 1)) -> tf.Tensor:
    """`tf.nn.depthwise_conv2d` (NHWC), with a gradient that DTensor can lay out.

    DTensor runs the forward kernel (DepthwiseConv2dNative) but has no layout
    propagation for its two gradient kernels. Here the input gradient is the forward
    kernel again (a full correlation of the stride-upsampled output gradient with the
    flipped filter), and the filter gradient one einsum per filter tap of a strided
    slice of the padded input with the output gradient; under DTensor a batch-sharded
    input's sums over the batch are reduced over the mesh. A dilated filter is applied
    as an undilated one with zeros between its taps (the same products).

    Args:
      x: [batch, height, width, channels]; height and width static.
      kernel: [kh, kw, channels, multiplier].
      strides: (sh, sw).
      padding: "SAME" or "VALID" (either case).
      dilations: (dh, dw); TensorFlow allows dilation only with stride 1.

    Returns:
      [batch, out_height, out_width, channels * multiplier], as tf.nn.depthwise_conv2d.
    """
    (sh, sw), (dh, dw), padding = tuple(strides), tuple(dilations), padding.upper()
    kh, kw, c, m = kernel.shape
    n_h, n_w = x.shape[1], x.shape[2]
    oh, pb_h, np_h = conv_geometry(n_h, kh, sh, dh, padding)
    ow, pb_w, np_w = conv_geometry(n_w, kw, sw, dw, padding)

    @tf.custom_gradient
    def core(x, kernel):
        y = tf.nn.depthwise_conv2d(x, dilate(kernel, dh, dw), [1, sh, sw, 1], padding)

        def grad(dy):  # dy [batch, oh, ow, c * m]
            # Input: the output gradient placed at its stride positions (zeros between),
            # padded for a full correlation with the flipped filter, then cropped.
            up = tf.pad(tf.reshape(dy, [-1, oh, 1, ow, 1, c * m]), [[0, 0], [0, 0], [0, sh - 1], [0, 0], [0, sw - 1], [0, 0]])
            up = tf.reshape(up, [-1, oh * sh, ow * sw, c * m])[:, : (oh - 1) * sh + 1, : (ow - 1) * sw + 1]
            eh, ew = (kh - 1) * dh, (kw - 1) * dw
            full = tf.pad(up, [[0, 0], [eh, np_h - (oh - 1) * sh - 1], [ew, np_w - (ow - 1) * sw - 1], [0, 0]])
            flipped = tf.reshape(dilate(kernel[::-1, ::-1], dh, dw), [eh + 1, ew + 1, c * m, 1])
            dx = tf.nn.depthwise_conv2d(full, flipped, [1, 1, 1, 1], "VALID")  # [batch, np_h, np_w, c * m]
            dx = tf.reduce_sum(tf.reshape(dx, [-1, np_h, np_w, c, m]), -1)[:, pb_h: pb_h + n_h, pb_w: pb_w + n_w]
            # Filter: tap (i, j) sees the padded input at rows i*dh + k*sh, columns j*dw + l*sw:
            # with the padded input cut into stride phases ([b, rows / sh, sh, cols / sw, sw, c]),
            # each tap's view is one contiguous slice of one phase, multiplied by the output
            # gradient and summed over batch and positions. (Strided slices measured 9x slower
            # at stride 2, and an einsum per tap 7-15x slower: it transposed both operands.)
            rows = -(-max(np_h, (kh - 1) * dh + (oh - 1) * sh + 1) // sh) * sh
            cols = -(-max(np_w, (kw - 1) * dw + (ow - 1) * sw + 1) // sw) * sw
            padded = tf.pad(x, [[0, 0], [pb_h, rows - n_h - pb_h], [pb_w, cols - n_w - pb_w], [0, 0]])
            phases = tf.reshape(padded, [-1, rows // sh, sh, cols // sw, sw, c, 1])
            dy5 = tf.reshape(dy, [-1, oh, ow, c, m])
            taps = [tf.reduce_sum(phases[:, (i * dh) // sh: (i * dh) // sh + oh, (i * dh) % sh,
                                         (j * dw) // sw: (j * dw) // sw + ow, (j * dw) % sw] * dy5, axis=[0, 1, 2])
                    for i in range(kh) for j in range(kw)]
            return dx, tf.reshape(tf.stack(taps), [kh, kw, c, m])

        return y, grad

    return core(x, kernel)


def avg_pool2d(x: tf.Tensor, pool_size=(2, 2), strides=(2, 2), padding: str = "VALID") -> tf.Tensor:
    """`tf.nn.avg_pool2d` (NHWC), with a gradient that DTensor can lay out.

    DTensor runs the forward AvgPool kernel but has no layout propagation for AvgPoolGrad.
    Here a window's sum is `depthwise_conv2d` with a filter of ones over the input padded
    with zeros (its input gradient is the forward kernel again; unequal strides, which
    that kernel refuses, run at stride 1 and keep every stride-th row and column), divided
    by the number of input positions the window covers: pool_h x pool_w, or with "SAME"
    padding fewer at the edges (TensorFlow's average leaves the padding out).

    Args:
      x: [batch, height, width, channels]; height and width static.
      pool_size, strides: (h, w).
      padding: "SAME" or "VALID" (either case).

    Returns:
      [batch, out_height, out_width, channels], as tf.nn.avg_pool2d.
    """
    (kh, kw), (sh, sw), padding = tuple(pool_size), tuple(strides), padding.upper()
    counts, pads, outs = [], [], []
    for size, k, s in ((x.shape[1], kh, sh), (x.shape[2], kw, sw)):
        out, before, padded = conv_geometry(size, k, s, 1, padding)
        starts = np.arange(out) * s - before
        counts.append(np.minimum(starts + k, size) - np.maximum(starts, 0))  # positions inside the input
        pads.append([before, padded - size - before])
        outs.append(out)
    count = (counts[0][:, None] * counts[1][None, :]).astype(np.float64)[None, :, :, None]  # [1, oh, ow, 1]
    ones = tf.ones([kh, kw, x.shape[-1], 1], x.dtype)
    x = tf.pad(x, [[0, 0]] + pads + [[0, 0]])
    if sh == sw:
        sums = depthwise_conv2d(x, ones, (sh, sw), "VALID")
    else:
        sums = depthwise_conv2d(x, ones, (1, 1), "VALID")[:, : (outs[0] - 1) * sh + 1: sh, : (outs[1] - 1) * sw + 1: sw]
    return sums * tf.constant(1.0 / count, x.dtype)
