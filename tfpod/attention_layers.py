"""Keras attention layers that run tfpod.attention's blockwise kernel.

`use_blockwise(layer)` changes the class of every tf_keras `MultiHeadAttention` inside
`layer` (and, with `decoder_self_attention=True`, every Model Garden `CachedAttention`) to a
subclass that computes the same function: same weights, names, configs and checkpoints.
When the step's attention takes segment masks (blockwise: `attention.current().segment_masks`,
read from the step context when the layer is traced) the stand-in attends with
`attention.attend_segments`, the masks of the call expressed as segment ids:

  * the Keras masks of the query [batch, T] and of the value / key [batch, S] (an
    `Embedding(mask_zero=True)` before it): a masked key is segment 0, a masked query
    segment -1 (it matches no key: Keras's all-masked row, which averages every value);
  * an `attention_mask` of shape [batch, 1, S] (a key mask: padding, every query alike);
  * `use_causal_mask=True` (Model Garden's decoder self-attention: always causal).

Its dropout on the probabilities runs in the kernel, seeded by the layer's own dropout
layer (`attention.dropout_seed`). Keras's own path (the [batch, heads, T, S] scores) stays
where the call cannot be expressed so: a dense [batch, T, S] `attention_mask`,
`return_attention_scores=True`, attention over more than one axis (`attention_axes`), a
length unknown when traced, a CachedAttention given a cache (decoding step by step);
`use_blockwise` logs the first such reason once per model.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import tensorflow as tf
import tf_keras

from tfpod import attention, compat

log = logging.getLogger("tfpod")


@dataclasses.dataclass
class Segments:
    """A call's mask as segment ids: queries [batch, T] and keys [batch, S] (None: no mask), causal."""

    q: tf.Tensor | None
    k: tf.Tensor | None
    causal: bool

    def dense(self, lq: int, lk: int) -> tf.Tensor | None:
        """The same mask as Keras's boolean [batch or 1, T, S] (None: every query attends every key)."""
        allowed = None
        if self.q is not None:
            allowed = tf.equal(tf.expand_dims(self.q, 2), tf.expand_dims(self.k, 1))
        if self.causal:
            lower = tf.linalg.band_part(tf.ones([1, lq, lk], tf.bool), -1, 0)
            allowed = lower if allowed is None else tf.logical_and(allowed, lower)
        return allowed


class _Notes:
    """Whether a model's stand-ins have logged why one attends materialized (one line a model)."""

    def __init__(self, model: str):
        self.model, self.logged = model, False


# The stand-ins `use_blockwise` made, each with its model's notes (held weakly: a model's layers go with it).
_NOTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def segments(query, value, key, attention_mask, causal: bool) -> tuple[Segments | None, str]:
    """(the call's mask as `Segments`, "") or (None, why it cannot be), from the inputs'
    Keras masks, `attention_mask` and `causal` (query [batch, T, ...], value [batch, S, ...])."""
    lq, lk = query.shape[1], value.shape[1]
    if lq is None or lk is None:
        return None, "a sequence length unknown when traced"
    keys = [m for m in (compat.keras_mask(value), None if key is None or key is value else compat.keras_mask(key))
            if m is not None]
    if attention_mask is not None:
        if attention_mask.shape.rank != 3 or attention_mask.shape[1] != 1:
            return None, f"a dense attention_mask of shape {attention_mask.shape} (segment ids express [batch, 1, S])"
        keys.append(tf.squeeze(attention_mask, 1))
    k = None
    for m in keys:
        k = tf.cast(m, tf.bool) if k is None else tf.logical_and(k, tf.cast(m, tf.bool))
    query_mask = compat.keras_mask(query)
    if query_mask is None and k is None:
        return Segments(None, None, causal), ""
    batch = tf.shape(query)[0]
    q = tf.ones(tf.stack([batch, lq]), tf.int32) if query_mask is None else \
        tf.where(tf.cast(query_mask, tf.bool), 1, -1)
    k = tf.ones(tf.stack([batch, lk]), tf.int32) if k is None else tf.cast(k, tf.int32)
    return Segments(q, k, causal), ""


def _blockwise_now(layer) -> bool:
    return attention.current().segment_masks and tuple(compat.attention_axes(layer) or (1,)) == (1,)


def _note(layer, why: str) -> None:
    notes = _NOTES.get(layer)
    if notes is not None and not notes.logged and attention.current().segment_masks:
        notes.logged = True
        log.info("model %r: attention layer %r attends materialized (Keras's path): %s", notes.model, layer.name, why)


def _attend(layer, query, key, value, mask: Segments, training) -> tf.Tensor:
    """The kernel on projected query [B, T, N, H], key and value [B, S, N, H] -> [B, T, N, H]."""
    q, k, v = (tf.transpose(x, [0, 2, 1, 3]) for x in (query, key, value))
    out = attention.attend_segments(q, k, v, mask.q, mask.k, mask.causal, compat.attention_dropout(layer), training)
    return tf.transpose(out, [0, 2, 1, 3])


class MultiHeadAttention(compat.multi_head_attention_with_steps()):
    """tf_keras's MultiHeadAttention, blockwise where its call's masks allow (module docstring)."""

    _tfpod_blockwise_call = False

    def call(self, query, value, key=None, attention_mask=None, return_attention_scores=False, training=None,
             use_causal_mask=False):
        if return_attention_scores:
            _note(self, "return_attention_scores=True")
        self._tfpod_blockwise_call = not return_attention_scores  # read by the two methods below
        try:
            return super().call(query, value, key=key, attention_mask=attention_mask,
                                return_attention_scores=return_attention_scores, training=training,
                                use_causal_mask=use_causal_mask)
        finally:
            self._tfpod_blockwise_call = False

    def call_mask(self, query, value, key=None, attention_mask=None, use_causal_mask=False):
        if self._tfpod_blockwise_call and _blockwise_now(self):
            mask, why = segments(query, value, key, attention_mask, use_causal_mask)
            if mask is not None:
                return mask
            _note(self, why)
        elif self._tfpod_blockwise_call:
            _note(self, f"attention over axes {compat.attention_axes(self)}")
        return super().call_mask(query, value, key=key, attention_mask=attention_mask, use_causal_mask=use_causal_mask)

    def attend(self, query, key, value, attention_mask=None, training=None):
        if isinstance(attention_mask, Segments):
            return _attend(self, query, key, value, attention_mask, training), None
        return super().attend(query, key, value, attention_mask, training)


_CAUSAL_CLASSES: dict[type, type] = {}


def _causal_cached_class(cls: type) -> type:
    """A subclass of Model Garden's CachedAttention (`cls`) for a decoder's self-attention: causal,
    `attention_mask` a key mask [batch, 1, S]; blockwise without a cache."""

    class CausalCachedAttention(cls):
        def call(self, query, value, key=None, attention_mask=None, cache=None, decode_loop_step=None,
                 return_attention_scores=False):
            compat.build_for_call(self, query, value, key)
            if cache is not None or return_attention_scores:  # decoding step by step: Model Garden's own masks
                return super().call(query, value, key=key, attention_mask=attention_mask, cache=cache,
                                    decode_loop_step=decode_loop_step, return_attention_scores=return_attention_scores)
            mask, why = segments(query, value, key, attention_mask, True)
            if mask is None or not _blockwise_now(self):
                if mask is None:
                    _note(self, why)
                    causal = compat.causal_mask(self, query, value)  # [1, T, S]
                    dense = causal if attention_mask is None else tf.logical_and(tf.cast(attention_mask, tf.bool), causal)
                else:
                    dense = mask.dense(query.shape[1], value.shape[1])  # the key mask and the causal mask
                return super().call(query, value, key=key, attention_mask=dense)
            q, k, v = compat.project_inputs(self, query, value, key)  # [B, T, N, H]; [B, S, N, H] each
            out = _attend(self, q, k, v, mask, compat.call_training())  # (this call has no `training` argument)
            return compat.project_output(self, out), cache

    CausalCachedAttention.__module__ = __name__
    CausalCachedAttention.__qualname__ = CausalCachedAttention.__name__
    return CausalCachedAttention


def use_blockwise(layer, decoder_self_attention: bool = False) -> list[str]:
    """Swaps every tf_keras MultiHeadAttention inside `layer` (not a subclass of it: a user's own
    attention is left as it is) for the blockwise stand-in; with `decoder_self_attention`, every
    Model Garden CachedAttention too (causal, its mask a key mask [batch, 1, S]). Returns the
    swapped layers' names."""
    notes = _Notes(layer.name)
    swapped = []
    for inner in compat.flatten_layers(layer):
        cls = type(inner)
        if cls is tf_keras.layers.MultiHeadAttention:
            inner.__class__ = MultiHeadAttention
        elif decoder_self_attention and cls.__name__ == "CachedAttention":
            inner.__class__ = _CAUSAL_CLASSES.setdefault(cls, _causal_cached_class(cls))
        else:
            continue
        _NOTES[inner] = notes
        swapped.append(inner.name)
    return swapped


_BUILT_CLASSES: dict[tuple[type, bool], type] = {}


def use_blockwise_when_built(layer, decoder_self_attention: bool = False) -> None:
    """`use_blockwise` for a layer that makes its attention layers in `build` (Model Garden's
    Transformer blocks): its class becomes a subclass whose `build` ends with it."""
    cls, key = type(layer), (type(layer), decoder_self_attention)
    if key not in _BUILT_CLASSES:
        def build(self, input_shape):
            cls.build(self, input_shape)
            use_blockwise(self, decoder_self_attention)

        _BUILT_CLASSES[key] = type(cls.__name__, (cls,), {"build": build, "__module__": __name__})
    layer.__class__ = _BUILT_CLASSES[key]
