"""Spatial partitioning: image rows split over a mesh axis, with tfpod's own halo exchange.

The MLPerf TPU-pod route past the batch-size limit for image models: each replica's
images are split by rows over `P` devices (the logical axis `height`, mapped to `model`
by the `spatial` preset), so a replica's activations take 1/P of the memory and its
convolutions 1/P of the time. DTensor's own convolution expander refuses this off TPU
("Halo exchange is only supported on TPU") and for strided convolutions on any device,
so the layers here do it themselves on any device type:

  x [B, H, W, C], rows over the axis       (each device: H/P consecutive rows)
    -> blocks [B, P, h, W, C]               a local reshape (h = H/P), block axis over the axis
    -> halo rows from the block above and below: the edge rows of every block, moved
       one block along by an einsum with a P x P shift matrix (DTensor all-reduces only
       those edge rows); the image's top and bottom get the padding value
    -> [B, P, before + h + after, W, C]     halo rows joined on the unsplit row axis
    -> the convolution (or pooling) on each block: one strided slice per filter tap,
       stacked and contracted with the filter in one einsum ("im2col")
    -> [B, P * h_out, W_out, C_out]         a local reshape: rows still over the axis

Padding: for SAME padding with the input height divisible by P x stride, block p's
output rows need exactly `pad_before` rows of block p-1 and `extent - stride -
pad_before` rows of block p+1, the same for every block; at the image's edges those
rows are the padding. Such layers keep their rows split.

A layer that cannot keep its rows split (a height not divisible by P x stride, VALID
padding whose output height is not input height / stride, halo wider than a block)
gathers the rows first and runs the plain TensorFlow op with the batch split only;
layers after it split the rows again where they can. `plan` says which; the model
logs it once (e.g. SSD's last feature maps, 3x3 and 1x1, run unsplit).

Batch norm needs nothing here: its moments over (batch, rows, columns) of a tensor
split over both axes are all-reduced over both (synchronized batch norm over the whole
global batch), and elementwise layers, residual additions and global pooling follow
the layouts of their inputs.

`use_spatial_layers(model)` swaps every Keras Conv2D and MaxPooling2D layer inside a
model for these (same weights, names and checkpoints); they run the plain op unless
the enclosing `activation_sharding` maps `height` to a mesh axis of more than one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tfpod import compat
from tfpod.fused import conv_geometry, dilate
from tfpod.partitioning.step_context import active_context, shard

log = logging.getLogger("tfpod")

HEIGHT = "height"  # the logical axis of image rows


@dataclasses.dataclass(frozen=True)
class RowGeometry:
    """How one layer's rows split: None halos when the layer runs unsplit.

    Attributes:
      blocks: P, devices along the row axis.
      out_rows: output height.
      before, after: halo rows taken from the block above / below (after < 0: the
        block's last -after rows are not needed).
      split: whether the layer keeps its rows split.
      reason: why not, when it does not.
    """

    blocks: int
    out_rows: int
    before: int
    after: int
    split: bool
    reason: str = ""


def plan(height: int, kernel: int, stride: int, dilation: int, padding: str, blocks: int) -> RowGeometry:
    """Whether a layer over `height` rows keeps them split over `blocks` devices, and its halos."""
    out, pad_before, _ = conv_geometry(height, kernel, stride, dilation, padding)
    extent = (kernel - 1) * dilation + 1
    before, after = pad_before, extent - stride - pad_before
    reason = ""
    if height % (blocks * stride):
        reason = f"height {height} is not divisible by {blocks} row blocks x stride {stride}"
    elif out * stride != height:
        reason = f"{padding} padding gives {out} output rows, not {height} / {stride}"
    elif max(before, after) > height // blocks:
        reason = f"its halo ({before} + {after} rows) is wider than a block of {height // blocks} rows"
    return RowGeometry(blocks, out, before, after, not reason, reason)


def row_split():
    """(mesh, row mesh axis, batch mesh axis) when the enclosing sharding splits image rows, else None."""
    active = active_context()
    if active is None:
        return None
    mesh, table = active.mesh, active.table
    axis = table.get(HEIGHT)
    if axis is None or axis not in mesh.dim_names or mesh.dim_size(axis) == 1:
        return None
    batch = table.get("batch")
    batch = batch if batch in mesh.dim_names and batch != axis else dtensor.UNSHARDED
    return mesh, axis, batch


def split_rows(images: tf.Tensor) -> tf.Tensor:
    """A model's input images [batch, H, W, C] laid out as fed (the batch split), then with
    their rows over the `height` axis where the sharding maps one (the model's first layer).

    The explicit first layout keeps DTensor from pushing the row split back into the
    input feed's ops (a gather of the step's batch failed SPMD expansion with it).
    """
    return shard(shard(images, ("batch", None, None, None)), ("batch", HEIGHT, None, None))


def _layout(mesh, *specs) -> dtensor.Layout:
    return dtensor.Layout([s or dtensor.UNSHARDED for s in specs], mesh)


def _shift(blocks: int, offset: int, dtype) -> tf.Tensor:
    """[P, P] with 1 at (q, p) where q = p + offset: einsum over q moves block p + offset to p."""
    m = np.zeros((blocks, blocks), np.float32)
    for p in range(blocks):
        if 0 <= p + offset < blocks:
            m[p + offset, p] = 1.0
    return tf.constant(m, dtype)


def _edge_fill(blocks: int, first: bool, fill: float, dtype) -> tf.Tensor | None:
    """[1, P, 1, 1, 1]: `fill` at the image's top (first) or bottom block, else 0 (None for fill 0)."""
    if fill == 0.0:
        return None
    m = np.zeros((1, blocks, 1, 1, 1), np.float32)
    m[0, 0 if first else blocks - 1] = fill
    return tf.constant(m, dtype)


def _with_halos(x: tf.Tensor, geometry: RowGeometry, split, fill: float) -> tf.Tensor:
    """x [B, H, W, C] (rows split) -> blocks with their halo rows [B, P, before + h + after', W, C]."""
    mesh, axis, batch = split
    p = geometry.blocks
    b, height, width, channels = x.shape
    h = height // p
    block_layout = _layout(mesh, batch, axis, None, None, None)
    xb = dtensor.relayout(tf.reshape(x, [-1, p, h, width, channels]), block_layout)  # [B, P, h, W, C]
    parts = []
    if geometry.before > 0:
        tail = xb[:, :, h - geometry.before:]  # each block's last rows, for the block below
        halo = tf.einsum("bqnwc,qp->bpnwc", tail, _shift(p, -1, x.dtype))
        edge = _edge_fill(p, True, fill, x.dtype)
        parts.append(dtensor.relayout(halo if edge is None else halo + edge, block_layout))
    parts.append(xb if geometry.after >= 0 else xb[:, :, :h + geometry.after])
    if geometry.after > 0:
        head = xb[:, :, :geometry.after]  # each block's first rows, for the block above
        halo = tf.einsum("bqnwc,qp->bpnwc", head, _shift(p, 1, x.dtype))
        edge = _edge_fill(p, False, fill, x.dtype)
        parts.append(dtensor.relayout(halo if edge is None else halo + edge, block_layout))
    return tf.concat(parts, axis=2) if len(parts) > 1 else parts[0]


_LOGGED: set = set()


def _whole_rows(x: tf.Tensor, rows: RowGeometry, split, what: str) -> tf.Tensor:
    """x with its rows gathered (the batch still split), for a layer that cannot split them; said once."""
    mesh, _, batch = split
    note = f"spatial: a {what} over {x.shape[1]}x{x.shape[2]} runs with whole rows ({rows.reason})"
    if note not in _LOGGED:
        _LOGGED.add(note)
        log.info("%s", note)
    return dtensor.relayout(x, _layout(mesh, batch, None, None, None))


def _taps(blocks: tf.Tensor, kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int],
          out_rows: int, width_geometry: tuple[int, int, int], fill: float) -> list[tf.Tensor]:
    """Each filter tap's input: strided slices of the haloed blocks [B, P, rows, W, C] -> [B, P, h_out, W_out, C]."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    width = blocks.shape[3]
    out_w, pad_w, padded_w = width_geometry
    if padded_w != width:
        blocks = tf.pad(blocks, [[0, 0], [0, 0], [0, 0], [pad_w, padded_w - width - pad_w], [0, 0]],
                        constant_values=fill)
    return [blocks[:, :, i * dh: i * dh + (out_rows - 1) * sh + 1: sh, j * dw: j * dw + (out_w - 1) * sw + 1: sw]
            for i in range(kh) for j in range(kw)]


def _plain_conv2d(x: tf.Tensor, kernel: tf.Tensor, strides, padding: str, dilations) -> tf.Tensor:
    """tf.nn.conv2d, a dilated kernel given as an undilated one with zeros between its taps
    (TensorFlow's CPU kernels without oneDNN have no gradient of a dilated tf.nn.conv2d)."""
    dh, dw = dilations
    return tf.nn.conv2d(x, dilate(kernel, dh, dw), strides, padding)


def conv2d(x: tf.Tensor, kernel: tf.Tensor, strides=(1, 1), padding: str = "SAME", dilations=(1, 1)) -> tf.Tensor:
    """`tf.nn.conv2d` (NHWC) with x's rows split over the enclosing sharding's `height` axis.

    Args:
      x: [batch, height, width, channels], static shape but the batch.
      kernel: [kh, kw, channels, filters].
      strides, dilations: (rows, columns).
      padding: "SAME" or "VALID".

    Returns:
      [batch, out_height, out_width, filters]: rows split when the layer keeps them
      split (`plan`), else the batch split only. Outside a row-splitting sharding, tf.nn.conv2d.

    Dilated kernels run, with their gradients, on every CPU kernel path (oneDNN or Eigen):
    split rows take strided slices per tap; whole rows and unsplit calls convolve with
    the kernel dilated by zeros (`fused.dilate`), not tf.nn.conv2d's dilations.
    """
    split = row_split()
    padding = padding.upper()
    if split is None:
        return _plain_conv2d(x, kernel, strides, padding, dilations)
    mesh, axis, batch = split
    (kh, kw, _, filters), (sh, sw), (dh, dw) = kernel.shape, tuple(strides), tuple(dilations)
    rows = plan(x.shape[1], kh, sh, dh, padding, mesh.dim_size(axis))
    if not rows.split:
        return _plain_conv2d(_whole_rows(x, rows, split, "convolution"), kernel, strides, padding, dilations)
    blocks = _with_halos(x, rows, split, 0.0)
    width = conv_geometry(x.shape[2], kw, sw, dw, padding)
    taps = _taps(blocks, (kh, kw), (sh, sw), (dh, dw), rows.out_rows // rows.blocks, width, 0.0)
    patches = tf.stack(taps, axis=4)  # [B, P, h', W', taps, C] (a new axis by slicing: no DTensor layout rule)
    y = tf.einsum("bphwtc,tcf->bphwf", patches, tf.reshape(kernel, [kh * kw, -1, filters]))
    y = tf.reshape(y, [-1, rows.out_rows, width[0], filters])  # [B, H', W', F]: block rows in order
    return dtensor.relayout(y, _layout(mesh, batch, axis, None, None))


def max_pool2d(x: tf.Tensor, pool: tuple[int, int], strides=(1, 1), padding: str = "SAME") -> tf.Tensor:
    """`tf.nn.max_pool2d` (NHWC) with x's rows split, like `conv2d` (padding taps never win)."""
    split = row_split()
    padding = padding.upper()
    if split is None:
        return tf.nn.max_pool2d(x, pool, strides, padding)
    mesh, axis, batch = split
    (ph, pw), (sh, sw) = tuple(pool), tuple(strides)
    rows = plan(x.shape[1], ph, sh, 1, padding, mesh.dim_size(axis))
    if not rows.split:
        return tf.nn.max_pool2d(_whole_rows(x, rows, split, "pooling"), pool, strides, padding)
    lowest = float(x.dtype.min)
    blocks = _with_halos(x, rows, split, lowest)
    width = conv_geometry(x.shape[2], pw, sw, 1, padding)
    taps = _taps(blocks, (ph, pw), (sh, sw), (1, 1), rows.out_rows // rows.blocks, width, lowest)
    y = taps[0]
    for t in taps[1:]:
        y = tf.maximum(y, t)
    y = tf.reshape(y, [-1, rows.out_rows, width[0], x.shape[3]])
    return dtensor.relayout(y, _layout(mesh, batch, axis, None, None))


_RECORD = threading.local()


@contextlib.contextmanager
def recording():
    """Within: each call of a layer of `use_spatial_layers` appends to the yielded list
    {"layer" (name), "id" (the layer object's), "shape" (global output shape), "rows_split" (bool), "bytes_per_device"}
    (the output's bytes one device holds, as laid out): bench/spatial.py's activation memory."""
    records: list[dict] = []
    previous = getattr(_RECORD, "value", None)
    _RECORD.value = records
    try:
        yield records
    finally:
        _RECORD.value = previous


def _record(layer: tf_keras.layers.Layer, y: tf.Tensor, height: int, kernel: int, stride: int, dilation: int,
            padding: str) -> tf.Tensor:
    records = getattr(_RECORD, "value", None)
    if records is None:
        return y
    split, shards, rows = row_split(), 1, False
    active = active_context()
    if active is not None:
        mesh, table = active.mesh, active.table
        batch = table.get("batch")
        shards = mesh.dim_size(batch) if batch in mesh.dim_names else 1
    if split is not None:
        rows = plan(height, kernel, stride, dilation, padding.upper(), split[0].dim_size(split[1])).split
        shards *= split[0].dim_size(split[1]) if rows else 1
    shape = [int(d) for d in y.shape]
    records.append({"layer": layer.name, "id": id(layer), "shape": shape, "rows_split": rows,
                    "bytes_per_device": int(np.prod(shape)) * y.dtype.size // shards})
    return y


@tf_keras.saving.register_keras_serializable(package="tfpod")
class Conv2D(tf_keras.layers.Conv2D):
    """Keras's Conv2D (same weights and config) whose convolution splits image rows (`conv2d`)."""

    def convolution_op(self, inputs, kernel):
        supported = (self.data_format == "channels_last" and isinstance(self.padding, str)
                     and self.padding in ("same", "valid") and self.groups == 1)
        if not supported or row_split() is None:
            y = super().convolution_op(inputs, kernel)
        else:
            y = conv2d(inputs, kernel, self.strides, self.padding, self.dilation_rate)
        return _record(self, y, inputs.shape[1], self.kernel_size[0], self.strides[0], self.dilation_rate[0],
                       str(self.padding))


@tf_keras.saving.register_keras_serializable(package="tfpod")
class MaxPooling2D(tf_keras.layers.MaxPooling2D):
    """Keras's MaxPooling2D whose pooling splits image rows (`max_pool2d`)."""

    def call(self, inputs):
        if self.data_format != "channels_last" or row_split() is None:
            y = super().call(inputs)
        else:
            y = max_pool2d(inputs, self.pool_size, self.strides, self.padding)
        return _record(self, y, inputs.shape[1], self.pool_size[0], self.strides[0], 1, self.padding)


_SWAPS = {tf_keras.layers.Conv2D: Conv2D, tf_keras.layers.MaxPooling2D: MaxPooling2D}


def use_spatial_layers(model: tf_keras.layers.Layer) -> None:
    """Makes every Keras Conv2D and MaxPooling2D layer inside `model` (those classes, not
    subclasses) split image rows when the sharding maps `height` to a mesh axis.
    Weights, names and checkpoints are unchanged; call it before the step is traced."""
    for layer in compat.flatten_layers(model):
        swap = _SWAPS.get(type(layer))
        if swap is not None:
            layer.__class__ = swap

