"""What DTensor cannot lay out in Keras 3's layers, computed another way on the mesh.

Probed with TF 2.20 and Keras 3.15 under ModelParallel on data:4,model:2 (docs/keras.md has
the table). While a model on the mesh traces its step (`steps.active_mesh()` is set),
`install`'s wrappers of the TensorFlow backend's functions do the same arithmetic in a
form DTensor lays out; elsewhere Keras's own functions run:

  conv, conv_transpose   DTensor convolves only with a replicated filter ("Filter for
                         convolution must have fully replicated layout"): a split kernel
                         is gathered where it is used (its gradient is split back); its
                         input and output are split over the batch only, as those of
                         pooling and resizing (DTensor's kernels refuse other splits)
  grouped conv           TensorFlow's CPU kernels have no grouped convolution (Keras compiles
                         it with XLA, which a DTensor step does not): a depthwise convolution
                         when each group is one channel, else one convolution per group
  depthwise_conv,        DTensor has no layout for DepthwiseConv2dNativeBackpropFilter:
  separable_conv         tfpod.fused.depthwise_conv2d (its own gradient), then the
                         pointwise convolution
  average_pool           no layout for AvgPoolGrad: tfpod.fused.avg_pool2d (1-D and 2-D);
                         3-D pooling of windows that do not overlap as a mean over a reshape
  Embedding              a table split by rows cannot be gathered ("sharded 0th dimension
                         for the resource tensor for ResourceGatherOp"): each device
                         gathers from its own rows and the rows are summed over the axis
  Normalization          a mean and variance given as arguments are host constants, which
                         a DTensor step cannot capture: they are placed on the mesh
  optimizer updates      an Embedding's gradient is IndexedSlices, whose scatter updates
                         DTensor cannot lay out (ResourceScatterAdd): made dense

What still cannot run (a recurrent layer's while loop over TensorLists without
`unroll=True`, 3-D average pooling of overlapping windows) stops at the first step with one
line naming the layer (steps.translate_error).
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod.keras3 import internals

_ORIGINAL = {}


def _mesh():
    from tfpod.keras3 import steps

    return steps.active_mesh()


def _replicated(x, mesh):
    return dtensor.relayout(x, dtensor.Layout.replicated(mesh, x.shape.rank))


def _batch_only(x, mesh):
    """An activation split over the batch axis only (its other dimensions whole on each device), or
    replicated when its batch does not divide: the layout tfpod.fused's padded kernels need."""
    from tfpod.keras3 import steps

    axis = steps.active_batch_axis()
    specs = [dtensor.UNSHARDED] * x.shape.rank
    if axis in mesh.dim_names and x.shape[0] is not None and x.shape[0] % mesh.dim_size(axis) == 0:
        specs[0] = axis
    layout = dtensor.Layout(specs, mesh)

    # The gradient is split over the batch only too (the kernels' gradients need it so), not laid
    # out like the input as DTensor's own (RelayoutLike) would: that fails after a residual sum of
    # activations split otherwise ("output layout of Relayout op after layout propagation does
    # not match"); DTensor lays it out as the layers before need.
    @tf.custom_gradient
    def relaid(x):
        return dtensor.relayout(x, layout), lambda dy: dtensor.relayout(dy, layout)

    return relaid(x)


def _gathering(name: str, kernels: tuple[str, ...]):
    """Keras's `name` with its kernel arguments relaid out replicated on the mesh, and its input
    split over the batch only (DTensor's convolution mis-sizes inputs split on other dimensions:
    "SPMD expansion resulted in op output inconsistent with the provided layout")."""
    original = _ORIGINAL[name]

    @functools.wraps(original)
    def function(inputs, *args, **kwargs):
        mesh = _mesh()
        if mesh is None:
            return original(inputs, *args, **kwargs)
        inputs = _batch_only(tf.convert_to_tensor(inputs), mesh)
        args = list(args)
        for index, key in enumerate(kernels):
            if index < len(args):
                args[index] = _replicated(tf.convert_to_tensor(args[index]), mesh)
            elif key in kwargs:
                kwargs[key] = _replicated(tf.convert_to_tensor(kwargs[key]), mesh)
        return _batch_only(original(inputs, *args, **kwargs), mesh)

    return function


def _pinned(original):
    """Keras's function with its input and output split over the batch only on the mesh: DTensor's
    pooling and resizing kernels (and their gradients) refuse activations split otherwise ("pad op
    with input layout different from op output layout", ResizeBilinearGrad), which a row-split
    kernel downstream makes of their output gradients."""

    @functools.wraps(original)
    def function(inputs, *args, **kwargs):
        mesh = _mesh()
        if mesh is None:
            return original(inputs, *args, **kwargs)
        return _batch_only(original(_batch_only(tf.convert_to_tensor(inputs), mesh), *args, **kwargs), mesh)

    return function


def _channels_last(data_format) -> bool:
    from keras.src import backend

    return backend.standardize_data_format(data_format) == "channels_last"


def _as_2d(inputs, kernel, strides, dilation_rate):
    """A 1-D depthwise problem as a 2-D one of height 1 (as Keras's own TensorFlow backend does)."""
    strides = (strides,) if isinstance(strides, int) else tuple(strides)
    dilation_rate = (dilation_rate,) if isinstance(dilation_rate, int) else tuple(dilation_rate)
    return tf.expand_dims(inputs, 1), tf.expand_dims(kernel, 0), (1,) + strides, (1,) + dilation_rate


def depthwise_conv(inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1):
    """keras.ops.depthwise_conv (TensorFlow backend), through tfpod.fused.depthwise_conv2d on the mesh."""
    mesh = _mesh()
    if mesh is None:
        return _ORIGINAL["depthwise_conv"](inputs, kernel, strides, padding, data_format, dilation_rate)
    from tfpod import fused

    inputs, kernel = _batch_only(tf.convert_to_tensor(inputs), mesh), _replicated(tf.convert_to_tensor(kernel), mesh)
    if not _channels_last(data_format):
        inputs = tf.transpose(inputs, [0] + list(range(2, inputs.shape.rank)) + [1])
    one_d = inputs.shape.rank == 3
    if one_d:
        inputs, kernel, strides, dilation_rate = _as_2d(inputs, kernel, strides, dilation_rate)
    strides = (strides,) * 2 if isinstance(strides, int) else tuple(strides)
    dilation_rate = (dilation_rate,) * 2 if isinstance(dilation_rate, int) else tuple(dilation_rate)
    out = fused.depthwise_conv2d(inputs, kernel, strides, padding.upper(), dilation_rate)
    if one_d:
        out = tf.squeeze(out, 1)
    if not _channels_last(data_format):
        out = tf.transpose(out, [0, out.shape.rank - 1] + list(range(1, out.shape.rank - 1)))
    return _batch_only(out, mesh)


def separable_conv(inputs, depthwise_kernel, pointwise_kernel, strides=1, padding="valid", data_format=None,
                   dilation_rate=1):
    """keras.ops.separable_conv: the depthwise convolution above, then a 1x1 convolution."""
    mesh = _mesh()
    if mesh is None:
        return _ORIGINAL["separable_conv"](inputs, depthwise_kernel, pointwise_kernel, strides, padding,
                                           data_format, dilation_rate)
    depthwise = depthwise_conv(inputs, depthwise_kernel, strides, padding, data_format, dilation_rate)
    return _ORIGINAL["conv"](depthwise, _replicated(tf.convert_to_tensor(pointwise_kernel), mesh), 1, "valid",
                             data_format, 1)


def conv(inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1):
    """keras.ops.conv on the mesh: a grouped convolution (TensorFlow's CPU kernels have none; Keras
    compiles it with XLA, which a DTensor step does not) as a depthwise convolution when every
    group is one channel, else one convolution per group; others as Keras's, the kernel gathered."""
    mesh = _mesh()
    inputs = tf.convert_to_tensor(inputs)
    channels = inputs.shape[-1] if _channels_last(data_format) else inputs.shape[1]
    per_group = kernel.shape[-2]
    if mesh is None or channels == per_group or inputs.shape.rank not in (3, 4):
        return _ORIGINAL["conv_gathered"](inputs, kernel, strides, padding, data_format, dilation_rate)
    kernel = _replicated(tf.convert_to_tensor(kernel), mesh)
    groups, out = channels // per_group, kernel.shape[-1]
    if per_group == 1:  # output channel o = c * m + j of group c: a depthwise multiplier m = out / channels
        shape = kernel.shape.as_list()[:-2] + [channels, out // channels]
        return depthwise_conv(inputs, tf.reshape(kernel, shape), strides, padding, data_format, dilation_rate)
    axis = -1 if _channels_last(data_format) else 1
    parts = [_ORIGINAL["conv_gathered"](x, k, strides, padding, data_format, dilation_rate)
             for x, k in zip(tf.split(inputs, groups, axis=axis), tf.split(kernel, groups, axis=-1))]
    return tf.concat(parts, axis=axis)


def average_pool(inputs, pool_size, strides=None, padding="valid", data_format=None):
    """keras.ops.average_pool: tfpod.fused.avg_pool2d (1-D, 2-D) or a mean over a reshape (3-D) on the mesh."""
    mesh = _mesh()
    rank = len(inputs.shape) - 2
    pool = (pool_size,) * rank if isinstance(pool_size, int) else tuple(pool_size)
    strides = pool if strides is None else ((strides,) * rank if isinstance(strides, int) else tuple(strides))
    if mesh is None or rank not in (1, 2, 3):
        return _ORIGINAL["average_pool"](inputs, pool_size, strides, padding, data_format)
    from tfpod import fused

    x = _batch_only(tf.convert_to_tensor(inputs), mesh)
    if not _channels_last(data_format):
        x = tf.transpose(x, [0] + list(range(2, rank + 2)) + [1])
    if rank == 3:
        spatial = x.shape[1:4]
        if pool != strides or padding.lower() != "valid" or any(s % p for s, p in zip(spatial, pool)):
            return _ORIGINAL["average_pool"](inputs, pool_size, strides, padding, data_format)  # refused at the step
        blocks = [-1] + [d for s, p in zip(spatial, pool) for d in (s // p, p)] + [x.shape[-1]]
        windows = _batch_only(tf.reshape(x, blocks), mesh)  # [b, d/p, p, h/p, p, w/p, p, c]
        out = tf.reduce_mean(windows, axis=[2, 4, 6])
    elif rank == 1:
        out = tf.squeeze(fused.avg_pool2d(tf.expand_dims(x, 1), (1,) + pool, (1,) + strides, padding.upper()), 1)
    else:
        out = fused.avg_pool2d(x, pool, strides, padding.upper())
    if not _channels_last(data_format):
        out = tf.transpose(out, [0, rank + 1] + list(range(1, rank + 1)))
    return _batch_only(out, mesh)


def rows_split_take(table: tf.Tensor, ids: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
    """table[ids] for a table [rows, width] split by rows over one mesh axis (`layout`, as it is computed with).

    The table is viewed as [S, rows / S, width] (S shards, one per device along the axis);
    the ids are repeated once per shard and made local ([S, *ids.shape], each shard's ids
    minus its first row), each device gathers from its own rows (batch_dims=1), rows owned
    by another shard are zeroed, and the shards' results are summed: every id is owned by
    exactly one shard. The gradient is dense, [S, rows / S, width].
    """
    axis, mesh = layout.sharding_specs[0], layout.mesh
    shards = mesh.dim_size(axis)
    rows, width = table.shape
    per = rows // shards
    blocks = tf.reshape(table, [shards, per, width])  # [S, rows/S, width]
    blocks = dtensor.relayout(blocks, dtensor.Layout([axis, dtensor.UNSHARDED, layout.sharding_specs[1]], mesh))
    ids = tf.cast(_replicated(tf.convert_to_tensor(ids), mesh), tf.int32)
    offsets = tf.reshape(tf.range(shards, dtype=tf.int32) * per, [shards] + [1] * ids.shape.rank)
    local = tf.expand_dims(ids, 0) - offsets  # [S, *ids.shape]
    local = dtensor.relayout(local, dtensor.Layout([axis] + [dtensor.UNSHARDED] * ids.shape.rank, mesh))
    owned = tf.logical_and(local >= 0, local < per)
    found = tf.gather(blocks, tf.clip_by_value(local, 0, per - 1), batch_dims=1)  # [S, *ids.shape, width]
    found = found * tf.cast(owned, found.dtype)[..., tf.newaxis]
    return tf.reduce_sum(found, axis=0)


def _embedding_call(original):
    @functools.wraps(original)
    def call(self, inputs, *args, **kwargs):
        from tfpod.keras3 import steps, variables

        table = internals.embedding_table(self)
        stored = getattr(internals.value_of(table), "layout", None) if table is not None else None
        if (_mesh() is None or not isinstance(stored, dtensor.Layout) or args or kwargs
                or self.quantization_mode is not None):
            return original(self, inputs, *args, **kwargs)
        layout = variables.compute_layout(stored, steps.active_batch_axis())  # as the step reads the table
        if layout.sharding_specs[0] == dtensor.UNSHARDED:
            return original(self, inputs, *args, **kwargs)
        out = rows_split_take(tf.convert_to_tensor(self.embeddings), inputs, layout)
        return tf.cast(out, self.compute_dtype)

    return call


def _normalization_build(original):
    @functools.wraps(original)
    def build(self, input_shape):
        original(self, input_shape)
        from keras import distribution as kd

        distribution = kd.distribution()
        if distribution is None:
            return
        from tfpod.keras3 import placement

        mesh = distribution.device_mesh.backend_mesh
        for name in ("mean", "variance"):
            value = getattr(self, name, None)
            if isinstance(value, tf.Tensor) and not dtensor.is_dtensor(value):
                setattr(self, name, placement.place(value.numpy(), dtensor.Layout.replicated(mesh, value.shape.rank)))

    return build


def _dense_gradients(original):
    """The optimizer's apply: sparse gradients made dense, and weights read as they are stored."""

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if _mesh() is None:
            return original(self, grads, trainable_variables)
        from tfpod.keras3 import variables

        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        variables.UPDATING.append(True)
        try:
            return original(self, grads, trainable_variables)
        finally:
            variables.UPDATING.pop()

    return apply


def install() -> None:
    """Wraps the TensorFlow backend's functions and the layers above (once)."""
    if _ORIGINAL:
        return
    nn = internals.nn_module()
    for name in ("conv", "conv_transpose", "depthwise_conv", "separable_conv", "average_pool"):
        _ORIGINAL[name] = getattr(nn, name)
    _ORIGINAL["conv_gathered"] = _gathering("conv", ("kernel",))
    nn.conv = conv
    nn.conv_transpose = _gathering("conv_transpose", ("kernel",))
    nn.depthwise_conv, nn.separable_conv, nn.average_pool = depthwise_conv, separable_conv, average_pool
    image = internals.image_module()
    for module, name in ((nn, "max_pool"), (image, "resize")):
        _ORIGINAL[name] = getattr(module, name)
        setattr(module, name, _pinned(_ORIGINAL[name]))
    from keras import layers

    _ORIGINAL["Embedding.call"] = layers.Embedding.call
    layers.Embedding.call = _embedding_call(layers.Embedding.call)
    _ORIGINAL["Normalization.build"] = layers.Normalization.build
    layers.Normalization.build = _normalization_build(layers.Normalization.build)
    optimizer = internals.tf_optimizer_class()
    _ORIGINAL["TFOptimizer.apply"] = optimizer.apply
    optimizer.apply = _dense_gradients(optimizer.apply)
