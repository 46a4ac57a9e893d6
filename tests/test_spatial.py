"""Spatial partitioning (tfpod.partitioning.spatial): convolutions and pooling on image rows
split over `model`, against the plain TensorFlow ops, forward and gradients, on the
8 logical CPU devices of the pytest process (mesh data:2,model:4)."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError
from tfpod.api import run
from tfpod.mesh import make_mesh
from tfpod.partitioning import activation_sharding, spatial


TABLE = {"batch": "data", "height": "model"}


def _value_and_grads(fn, x, k):
    """fn(x, k) and d sum(fn * w) / d (x, k) for a fixed random w."""
    with tf.GradientTape() as tape:
        tape.watch([x, k])
        y = fn(x, k)
        total = tf.reduce_sum(y * tf.random.stateless_normal(y.shape, seed=[7, 7]))
    return [y, *tape.gradient(total, [x, k])]


def _dilated_by_hand(k, dilation):
    """k [kh, kw, c, f] with dilation - 1 zero rows and columns between its taps, by a
    product with 0/1 placement matrices: tf.nn.conv2d with it is the dilated convolution
    on every CPU kernel path (TensorFlow's Eigen kernels, without oneDNN, have no gradient
    of tf.nn.conv2d with dilations > 1)."""
    place = lambda n: np.eye(n * dilation)[:: dilation][:, : (n - 1) * dilation + 1].T.astype(np.float32)
    return tf.einsum("ai,bj,ijcf->abcf", place(k.shape[0]), place(k.shape[1]), k)


def _conv2d_reference(stride, padding, dilation):
    return lambda x, k: tf.nn.conv2d(x, _dilated_by_hand(k, dilation), stride, padding)


def _split_and_plain(op, plain, x, k):
    """(split results as numpy, the output's layout, plain results) of op vs plain on data:2,model:4."""
    mesh = make_mesh("data:2,model:4")
    rows = dtensor.Layout(["data", "model", dtensor.UNSHARDED, dtensor.UNSHARDED], mesh)

    @tf.function
    def split(x, k):
        with activation_sharding(mesh, TABLE):
            return _value_and_grads(op, dtensor.relayout(x, rows), k)

    replicated = [dtensor.copy_to_mesh(t, dtensor.Layout.replicated(mesh, t.shape.rank)) for t in (x, k)]
    got = split(*replicated)
    layout = dtensor.fetch_layout(got[0]).sharding_specs
    got = [dtensor.relayout(g, dtensor.Layout.replicated(mesh, g.shape.rank)).numpy() for g in got]
    return got, layout, [t.numpy() for t in _value_and_grads(plain, x, k)]


@pytest.mark.parametrize("size,stride,padding,dilation,rows_split", [
    (3, 1, "SAME", 1, True),
    (3, 2, "SAME", 1, True),
    (7, 2, "SAME", 1, True),   # the ResNet stem: halo of 2 rows above, 3 below
    (1, 2, "SAME", 1, True),   # a projection shortcut: the block's last row is not needed
    (3, 1, "SAME", 2, True),   # dilated: halo of 2 rows
    (1, 1, "VALID", 1, True),
    (3, 1, "VALID", 1, False),  # 14 output rows of 16 do not split into 4 equal blocks: whole rows
    (3, 2, "VALID", 1, False),
    (3, 1, "VALID", 2, False),  # dilated, whole rows: 12 output rows
])
def test_convolution_with_split_rows_equals_conv2d(size, stride, padding, dilation, rows_split):
    """Dilated kernels run with their gradients on either CPU kernel path (oneDNN, or Eigen
    with TF_ENABLE_ONEDNN_OPTS=0 or without AVX-512); the reference dilates by hand."""
    x = tf.random.stateless_normal([4, 16, 12, 3], seed=[1, 2])
    k = tf.random.stateless_normal([size, size, 3, 5], seed=[3, 4])
    got, layout, want = _split_and_plain(
        lambda x, k: spatial.conv2d(x, k, (stride, stride), padding, (dilation, dilation)),
        _conv2d_reference(stride, padding, dilation), x, k)
    assert layout[:2] == (["data", "model"] if rows_split else ["data", dtensor.UNSHARDED])
    for g, w in zip(got, want):  # output, input gradient, filter gradient
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


def _dilated_conv2d_float64(x, k, w, pad):
    """The 3x3 convolution with dilation 2 of x [b, h, w, c] padded by `pad` with k, and the
    gradients of sum(output * w) by x and k: float64 sums over the taps."""
    xp = np.pad(x, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
    oh, ow = xp.shape[1] - 4, xp.shape[2] - 4
    window = lambda i, j: (slice(None), slice(2 * i, 2 * i + oh), slice(2 * j, 2 * j + ow))  # tap (i, j)'s inputs
    y = sum(np.einsum("bhwc,cf->bhwf", xp[window(i, j)], k[i, j]) for i in range(3) for j in range(3))
    dxp = np.zeros_like(xp)
    for i in range(3):
        for j in range(3):
            dxp[window(i, j)] += np.einsum("bhwf,cf->bhwc", w, k[i, j])
    dk = np.stack([np.stack([np.einsum("bhwc,bhwf->cf", xp[window(i, j)], w) for j in range(3)]) for i in range(3)])
    return y, dxp[:, pad: pad + x.shape[1], pad: pad + x.shape[2]], dk


@pytest.mark.unit
@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_dilated_convolution_without_split_rows_equals_float64(padding):
    """Outside a row-splitting sharding spatial.conv2d is a plain convolution, a dilated one
    too, with its gradients, on either CPU kernel path: against float64 NumPy sums over the
    taps. Error model: float32 sums of n products (n = 27 for the output, 36 for the input
    gradient, 144 for the filter's) are within (n + 2) U32 times the same sums of absolute
    values (U32 = 2^-24, float32's unit roundoff)."""
    x = tf.random.stateless_normal([2, 9, 8, 3], seed=[1, 2])
    k = tf.random.stateless_normal([3, 3, 3, 4], seed=[3, 4])
    got = _value_and_grads(lambda x, k: spatial.conv2d(x, k, (1, 1), padding, (2, 2)), x, k)
    w = tf.random.stateless_normal(got[0].shape, seed=[7, 7]).numpy()  # as _value_and_grads weighs the output
    pad = 2 if padding == "SAME" else 0
    as64 = lambda t: np.asarray(t, np.float64)
    want = _dilated_conv2d_float64(as64(x), as64(k), as64(w), pad)
    magnitude = _dilated_conv2d_float64(np.abs(as64(x)), np.abs(as64(k)), np.abs(as64(w)), pad)
    for g, want, magnitude, n in zip(got, want, magnitude, [27, 36, 144]):
        assert g.shape == want.shape
        assert (np.abs(g.numpy() - want) <= (n + 2) * 2.0 ** -24 * magnitude).all()


@pytest.mark.unit
@pytest.mark.parametrize("size,stride", [(3, 2), (2, 2), (3, 1)])
def test_max_pooling_with_split_rows_equals_max_pool(size, stride):
    """Padding never wins a max, also where every value is negative (the image's edges)."""
    x = tf.random.stateless_normal([4, 16, 12, 3], seed=[1, 2]) - 3.0
    got, layout, want = _split_and_plain(lambda x, k: spatial.max_pool2d(x, (size, size), (stride, stride)) + 0 * k,
                                         lambda x, k: tf.nn.max_pool2d(x, size, stride, "SAME") + 0 * k,
                                         x, tf.constant(0.0))
    assert layout[:2] == ["data", "model"]
    for g, w in zip(got[:2], want[:2]):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.unit
def test_plan_says_why_rows_stay_whole():
    assert spatial.plan(32, 3, 2, 1, "SAME", 4).split
    assert "not divisible by 4 row blocks x stride 2" in spatial.plan(20, 3, 2, 1, "SAME", 4).reason
    assert "VALID padding gives 30 output rows" in spatial.plan(32, 3, 1, 1, "VALID", 4).reason
    assert "wider than a block" in spatial.plan(8, 7, 1, 1, "SAME", 4).reason
    geometry = spatial.plan(64, 7, 2, 1, "SAME", 4)
    assert (geometry.before, geometry.after, geometry.out_rows) == (2, 3, 32)


@pytest.mark.unit
def test_spatial_preset_on_a_model_without_image_rows_is_one_line(tmp_path):
    with pytest.raises(UserError, match="model 'gpt' has no image rows to split: spatial partitioning is for resnet"):
        run(["gin/lm_tiny.gin"], ["train.steps=1", "sharding.preset='spatial'", "train.synthetic_data=True"],
            str(tmp_path / "run"), mesh_spec="data:2,model:4")
