"""Keras layers whose TensorFlow kernels DTensor cannot lay out, and their stand-ins.

`use_mesh_layers(model)` (called by compile on the mesh) changes the class of every
layer listed in `STAND_INS` to a subclass that computes the same function with ops
DTensor can lay out. Weights, names, configs and checkpoints stay the same; a
subclass of one of these layers written by a user is left as it is (the compile-time
trace, `tfpod.keras.support`, names it if it still uses an unsupported kernel).

  BatchNormalization   FusedBatchNormV3 and its gradient: trains through
                       `tfpod.fused.batch_norm` (fused.BatchNormalization)
  LayerNormalization   its fused kernel: Keras's unfused form
  DepthwiseConv1D/2D,  the two gradient kernels of DepthwiseConv2dNative: the forward
  SeparableConv1D/2D   kernel with `tfpod.fused.depthwise_conv2d`'s gradient
  Conv2D(groups > 1)   TensorFlow's CPU kernel has no grouped form (Keras uses XLA there):
                       a depthwise convolution, or one convolution per group
  AveragePooling1D/2D  AvgPool's gradient kernel: `tfpod.fused.avg_pool2d` (a depthwise
                       sum with that function's gradient, divided by the window's count)
  Normalization        its mean and variance read into constants when built (the
                       variables are not initialized then): read in each call;
                       swapped when made under tfpod.sharding, not at compile
  Embedding            with its table's rows split over a mesh axis (DTensor's gather
                       needs whole rows): a tfpod.embedding table, each device
                       looking up and updating only its own rows (tfpod.keras.tables;
                       where that path cannot run, a one-hot matmul);
                       Model Garden's OnDeviceEmbedding is switched to its own one-hot mode

Other Embeddings' sparse gradients are made dense before the optimizer (DTensor cannot
lay out the scatter of a sparse update): see `tfpod.keras.compile.mesh_optimizer`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras

from tfpod import compat, embedding, fused, partitioning
from tfpod.keras.layout_map import is_dvariable, set_values


def _depthwise_call(layer, inputs, kernel, strides, dilations, pointwise=None, one_d=False):
    """The depthwise (then pointwise) convolution of a Keras conv layer, bias and activation."""
    x = inputs
    if layer.padding == "causal":
        x = tf.pad(x, compat.causal_padding(layer, x))
    first = layer.data_format == "channels_first"
    if one_d:  # [batch, steps, channels] -> [batch, 1, steps, channels], as Keras does
        x = tf.expand_dims(x, 2 if first else 1)
        kernel = tf.expand_dims(kernel, 0)  # not kernel[None]: DTensor mis-expands a new-axis slice
        pointwise = None if pointwise is None else tf.expand_dims(pointwise, 0)
        strides, dilations = (1,) + tuple(strides), (1,) + tuple(dilations)
    if first:
        x = tf.transpose(x, [0, 2, 3, 1])
    padding = "VALID" if layer.padding == "causal" else layer.padding
    y = fused.depthwise_conv2d(x, kernel, strides, padding, dilations)
    if pointwise is not None:
        y = tf.nn.conv2d(y, pointwise, 1, "VALID")
    if layer.use_bias:
        y = tf.nn.bias_add(y, layer.bias)
    if first:
        y = tf.transpose(y, [0, 3, 1, 2])
    if one_d:
        y = tf.squeeze(y, [2 if first else 1])
    return layer.activation(y) if layer.activation is not None else y


@tf_keras.saving.register_keras_serializable(package="tfpod")
class DepthwiseConv2D(tf_keras.layers.DepthwiseConv2D):
    """Keras's DepthwiseConv2D with `fused.depthwise_conv2d` (a gradient DTensor can lay out)."""

    def call(self, inputs):
        return _depthwise_call(self, inputs, self.depthwise_kernel, self.strides, self.dilation_rate)


@tf_keras.saving.register_keras_serializable(package="tfpod")
class DepthwiseConv1D(tf_keras.layers.DepthwiseConv1D):
    """Keras's DepthwiseConv1D with `fused.depthwise_conv2d`."""

    def call(self, inputs):
        return _depthwise_call(self, inputs, self.depthwise_kernel, self.strides, self.dilation_rate, one_d=True)


@tf_keras.saving.register_keras_serializable(package="tfpod")
class SeparableConv2D(tf_keras.layers.SeparableConv2D):
    """Keras's SeparableConv2D: `fused.depthwise_conv2d`, then the 1x1 pointwise convolution."""

    def call(self, inputs):
        return _depthwise_call(self, inputs, self.depthwise_kernel, self.strides, self.dilation_rate,
                               pointwise=self.pointwise_kernel)


@tf_keras.saving.register_keras_serializable(package="tfpod")
class SeparableConv1D(tf_keras.layers.SeparableConv1D):
    """Keras's SeparableConv1D: `fused.depthwise_conv2d`, then the pointwise convolution."""

    def call(self, inputs):
        return _depthwise_call(self, inputs, self.depthwise_kernel, self.strides, self.dilation_rate,
                               pointwise=self.pointwise_kernel, one_d=True)


@tf_keras.saving.register_keras_serializable(package="tfpod")
class GroupedConv2D(tf_keras.layers.Conv2D):
    """Keras's Conv2D with groups > 1 (ConvNeXt's 7x7 convolutions): Keras runs it through
    XLA on a CPU, which a DTensor step inlines into TensorFlow's CPU kernel, which has no
    grouped form ("Fused conv implementation does not support grouped convolutions").
    One group per channel is `fused.depthwise_conv2d`; other groupings convolve each
    group's channels and concatenate."""

    def call(self, inputs):
        channels = inputs.shape[1 if self.data_format == "channels_first" else -1]
        if self.groups == channels == self.filters:  # kernel [h, w, 1, C] -> depthwise [h, w, C, 1]
            return _depthwise_call(self, inputs, tf.transpose(self.kernel, [0, 1, 3, 2]), self.strides,
                                   self.dilation_rate)
        first = self.data_format == "channels_first"
        x = tf.transpose(inputs, [0, 2, 3, 1]) if first else inputs
        parts = zip(tf.split(x, self.groups, axis=-1), tf.split(self.kernel, self.groups, axis=-1))
        y = tf.concat([tf.nn.conv2d(xi, ki, self.strides, self.padding.upper(), dilations=self.dilation_rate)
                       for xi, ki in parts], axis=-1)
        if self.use_bias:
            y = tf.nn.bias_add(y, self.bias)
        y = tf.transpose(y, [0, 3, 1, 2]) if first else y
        return self.activation(y) if self.activation is not None else y


def _avg_pool_call(layer, inputs, one_d=False):
    """The average pooling of a Keras pooling layer through `fused.avg_pool2d`."""
    first = layer.data_format == "channels_first"
    x, pool, strides = inputs, tuple(layer.pool_size), tuple(layer.strides)
    if one_d:  # [batch, steps, channels] -> [batch, steps, 1, channels]
        x = tf.expand_dims(x, 3 if first else 2)
        pool, strides = pool + (1,), strides + (1,)
    if first:
        x = tf.transpose(x, [0, 2, 3, 1])
    y = fused.avg_pool2d(x, pool, strides, layer.padding)
    if first:
        y = tf.transpose(y, [0, 3, 1, 2])
    return tf.squeeze(y, [3 if first else 2]) if one_d else y


@tf_keras.saving.register_keras_serializable(package="tfpod")
class AveragePooling2D(tf_keras.layers.AveragePooling2D):
    """Keras's AveragePooling2D with `fused.avg_pool2d` (a gradient DTensor can lay out)."""

    def call(self, inputs):
        return _avg_pool_call(self, inputs)


@tf_keras.saving.register_keras_serializable(package="tfpod")
class AveragePooling1D(tf_keras.layers.AveragePooling1D):
    """Keras's AveragePooling1D with `fused.avg_pool2d`."""

    def call(self, inputs):
        return _avg_pool_call(self, inputs, one_d=True)


@tf_keras.saving.register_keras_serializable(package="tfpod")
class Normalization(tf_keras.layers.Normalization):
    """Keras's Normalization reading its mean and variance variables in each call.

    Keras reads them once, into constants, when the layer is built or adapted
    (`finalize_state`): built under tfpod.sharding, where the variables are not yet
    initialized, that read failed ("Input to reshape is a tensor with 0 values"; every
    EfficientNet starts with this layer), and a constant taken there would not be on the
    mesh (nor are the constants Keras makes of a mean and variance given as numbers, as
    ConvNeXt's: "got a regular tensor ... but was expecting a DTensor" at the first step). Swapped in when the layer is made under tfpod.sharding (tfpod.keras.hooks)."""

    def finalize_state(self):
        pass  # nothing to cache: `call` reads the variables

    def adapt(self, data, batch_size=None, steps=None):
        """Keras's own adapt, on a plain Normalization off the mesh (Keras's adapt loop stops on lazy
        variables, "can only convert an array of size 1 to a Python scalar", and on DVariables, a
        DTensor iterator error), then its statistics copied in: assigned where this layer's variables
        are on the mesh, or made the initial values of lazy ones (placed with the model around them)."""
        with compat.layout_map_lib().layout_map_scope(None), compat.lazy_variable().disable_init_variable_creator():
            plain = tf_keras.layers.Normalization(axis=self.axis, invert=self.invert)
            plain.adapt(data, batch_size=batch_size, steps=steps)
        if not self.built:
            shape = data.element_spec.shape if isinstance(data, tf.data.Dataset) else np.shape(data)
            self.build([None] + list(shape)[1:])
        for variable, value in zip((self.adapt_mean, self.adapt_variance, self.count),
                                   (plain.adapt_mean, plain.adapt_variance, plain.count)):
            if compat.set_lazy_initial_value(variable, tf.constant(value.numpy())):
                continue
            if is_dvariable(compat.inner_variable(variable)):
                set_values([variable], [value.numpy()])
            else:  # built outside tfpod.sharding (compile says so)
                variable.assign(value)

    def call(self, inputs):
        x = tf.cast(compat.normalization_inputs(self, inputs), self.compute_dtype)
        broadcast, keep_axes = compat.normalization_shapes(self)
        if self.input_mean is not None:  # given as numbers (ConvNeXt's): constants made in the step, not
            kept = [broadcast[d] for d in keep_axes]  # captured ones off the mesh
            mean, variance = (np.reshape(v * np.ones(kept), broadcast) for v in (self.input_mean, self.input_variance))
        else:
            mean, variance = (tf.reshape(v, broadcast) for v in (self.adapt_mean, self.adapt_variance))
        mean, variance = (tf.cast(v, self.compute_dtype) for v in (mean, variance))
        scale = tf.maximum(tf.sqrt(variance), tf_keras.backend.epsilon())
        return mean + x * scale if self.invert else (x - mean) / scale


@tf_keras.saving.register_keras_serializable(package="tfpod")
class OneHotEmbedding(tf_keras.layers.Embedding):
    """Keras's Embedding as a one-hot matmul, for a table whose vocab rows are split over a mesh axis."""

    def call(self, inputs):
        ids = tf.cast(inputs, tf.int32)
        one_hot = tf.one_hot(tf.reshape(ids, [-1]), self.input_dim, dtype=self.embeddings.dtype)  # [ids, vocab]
        out = tf.matmul(one_hot, self.embeddings)  # [ids, output_dim]
        out = tf.reshape(out, [d if d is not None else -1 for d in ids.shape] + [self.output_dim])
        return tf.cast(out, self.compute_dtype)


@tf_keras.saving.register_keras_serializable(package="tfpod")
class TableEmbedding(OneHotEmbedding, embedding.TableLayer):
    """Keras's Embedding with its rows split over a mesh axis, as a tfpod.embedding table: in
    fit, evaluate and predict (tfpod.keras.tables) each device looks up (and updates) only its
    own rows, the gradient is rows, never a dense table; a model that path cannot run keeps
    the one-hot matmul."""

    combiner = None  # one row per id, as Keras's
    source = None  # the model input holding its ids (tfpod.keras.tables.attach)

    def call(self, inputs):
        scope = embedding.layer.active_scope()
        if scope is not None and id(self) in scope.partials:
            return tf.cast(embedding.layer.from_partials(self, tf.cast(inputs, tf.int32), scope), self.compute_dtype)
        return super().call(inputs)


STAND_INS = {
    tf_keras.layers.DepthwiseConv2D: DepthwiseConv2D,
    tf_keras.layers.DepthwiseConv1D: DepthwiseConv1D,
    tf_keras.layers.SeparableConv2D: SeparableConv2D,
    tf_keras.layers.SeparableConv1D: SeparableConv1D,
    tf_keras.layers.AveragePooling2D: AveragePooling2D,
    tf_keras.layers.AveragePooling1D: AveragePooling1D,
}


def use_mesh_layers(model: tf_keras.layers.Layer) -> list[str]:
    """Swaps, inside `model`, every layer DTensor cannot run for its stand-in (see the module
    docstring); call it before the train step is traced. Returns the swapped layers' names."""
    swapped = []
    fused.use_batch_norm(model)  # Keras's own BatchNormalization class
    for layer in compat.flatten_layers(model):
        stand_in = STAND_INS.get(type(layer))
        if stand_in is not None:
            layer.__class__ = stand_in
            swapped.append(layer.name)
        elif type(layer) is tf_keras.layers.Conv2D and layer.groups > 1:
            layer.__class__ = GroupedConv2D
            swapped.append(layer.name)
        elif type(layer) is tf_keras.layers.Embedding and partitioning.rows_split(layer.embeddings):
            layer.__class__ = TableEmbedding  # (tfpod.embedding's sparse lookups and updates in fit)
            swapped.append(layer.name)
        elif type(layer).__name__ == "OnDeviceEmbedding" and partitioning.rows_split(layer.embeddings):
            compat.set_one_hot(layer, True)  # Model Garden's own one-hot lookup
        else:
            compat.unfuse_normalization(layer)  # layer norm; batch norm subclasses (SyncBatchNormalization)
    return swapped
