"""The internals of tf_keras's MultiHeadAttention (and Model Garden's CachedAttention, its
subclass) that tfpod's blockwise stand-ins (tfpod.attention_layers) take over or read: the
two private steps of its `call`, its projections, attention axes and dropout layer.
"""

from __future__ import annotations

from tfpod.compat.keras_layers import tf_keras

_STEPS: list[type] = []


def multi_head_attention_with_steps() -> type:
    """tf_keras's MultiHeadAttention with the two steps of its `call` a subclass replaces as
    methods of its own (tf_keras 2.20's private `_compute_attention_mask` and
    `_compute_attention` call them):

      call_mask(query, value, key=None, attention_mask=None, use_causal_mask=False): the mask
        `attend` is given (by default tf_keras's: [batch, T, S] bool, or None);
      attend(query, key, value, attention_mask=None, training=None): (output [B, T, N, H],
        scores or None) from the projected query [B, T, N, H], key and value [B, S, N, H]
        (by default tf_keras's softmax, dropout and einsum).
    """
    if not _STEPS:
        base = tf_keras().layers.MultiHeadAttention

        class MultiHeadAttentionSteps(base):
            def call_mask(self, query, value, key=None, attention_mask=None, use_causal_mask=False):
                return base._compute_attention_mask(self, query, value, key=key, attention_mask=attention_mask,
                                                    use_causal_mask=use_causal_mask)

            def attend(self, query, key, value, attention_mask=None, training=None):
                return base._compute_attention(self, query, key, value, attention_mask, training)

            def _compute_attention_mask(self, query, value, key=None, attention_mask=None, use_causal_mask=False):
                return self.call_mask(query, value, key=key, attention_mask=attention_mask,
                                      use_causal_mask=use_causal_mask)

            def _compute_attention(self, query, key, value, attention_mask=None, training=None):
                return self.attend(query, key, value, attention_mask, training)

        MultiHeadAttentionSteps.__qualname__ = MultiHeadAttentionSteps.__name__
        _STEPS.append(MultiHeadAttentionSteps)
    return _STEPS[0]


def attention_axes(layer) -> tuple | None:
    """The axes a MultiHeadAttention attends over (None: the sequence axis alone)."""
    return layer._attention_axes


def attention_dropout(layer):
    """A MultiHeadAttention's dropout layer on the attention probabilities."""
    return layer._dropout_layer


def build_for_call(layer, query, value, key=None) -> None:
    """Builds a MultiHeadAttention's projections for its first call's inputs, as its `call` does first."""
    if not layer._built_from_signature:
        layer._build_from_signature(query=query, value=value, key=key)


def causal_mask(layer, query, value):
    """A MultiHeadAttention's causal mask of a call: [1, T, S] bool, lower triangular."""
    return layer._compute_causal_mask(query, value)


def project_inputs(layer, query, value, key=None) -> tuple:
    """A MultiHeadAttention's projections, in its order: query [B, T, N, H], then key and
    value [B, S, N, H] (`key` None: the value)."""
    q = layer._query_dense(query)
    k = layer._key_dense(value if key is None else key)
    v = layer._value_dense(value)
    return q, k, v


def project_output(layer, x):
    """A MultiHeadAttention's output projection of x [B, T, N, H] -> [B, T, width]."""
    return layer._output_dense(x)
