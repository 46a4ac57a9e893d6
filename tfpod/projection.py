"""Projection: the linear layer tfpod's language models are built of (GPT's, Llama's), here
below the models so that what adapts linear layers (tfpod.lora) knows it by its class."""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from tfpod.partitioning import context


def leading_dims(x: tf.Tensor, n: int) -> list:
    """x's first n dimensions: static where known (as DTensor needs), else dynamic (serving)."""
    return [d if d is not None else tf.shape(x)[i] for i, d in enumerate(x.shape[:n])]


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


class Projection(tf_keras.layers.Layer):
    """x [..., *in_dims] -> x @ kernel + bias [..., *out_dims], computed as one 2-D matmul.

    The kernel keeps its logical shape [*in_dims, *out_dims] (e.g. query [embed, heads,
    kv], the names and shapes of Model Garden's EinsumDense layers, so the sharding rules
    and checkpoints are theirs), and is reshaped to [prod(in), prod(out)] for the matmul:
    oneDNN runs a 2-D matmul's gradients (matmuls with transposed operands) faster than
    the einsums an EinsumDense differentiates into (docs/benchmarks.md).
    """

    def __init__(self, in_dims, out_dims, kernel_initializer, use_bias: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.in_dims, self.out_dims = tuple(in_dims), tuple(out_dims)
        self.kernel_initializer, self.use_bias = kernel_initializer, use_bias

    def build(self, input_shape):
        self.kernel = self.add_weight("kernel", self.in_dims + self.out_dims, initializer=self.kernel_initializer)
        if self.use_bias:
            self.bias = self.add_weight("bias", self.out_dims, initializer="zeros")
        super().build(input_shape)

    def call(self, x):
        lead = x.shape[: x.shape.rank - len(self.in_dims)]
        n_in, n_out = _prod(self.in_dims), _prod(self.out_dims)
        flat = context.flat_tokens(x, n_in)  # [tokens, prod(in_dims)]
        y = context.token_matmul(flat, tf.reshape(self.kernel, [n_in, n_out]))
        if self.use_bias:
            y = tf.nn.bias_add(y, tf.reshape(self.bias, [n_out]))
        return tf.reshape(y, leading_dims(x, len(lead)) + list(self.out_dims))  # [..., *out_dims]

    def get_config(self):
        return {**super().get_config(), "in_dims": self.in_dims, "out_dims": self.out_dims, "use_bias": self.use_bias}
