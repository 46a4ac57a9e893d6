"""Model Garden layers' internals: OnDeviceEmbedding's one-hot switch and initializer,
PositionEmbedding's table, BertEncoderV2's blocks, embeddings and masks.
"""

from __future__ import annotations


def set_one_hot(embedding, on: bool) -> None:
    """Model Garden's OnDeviceEmbedding: look up by a one-hot matmul (True) or a gather."""
    embedding._use_one_hot = on


def position_embeddings(layer):
    """Model Garden's PositionEmbedding table [max_length, width]."""
    return layer._position_embeddings


def transformer_layers(encoder) -> list:
    """Model Garden's BertEncoderV2 blocks."""
    return encoder._transformer_layers


def set_transformer_layers(encoder, layers: list) -> None:
    encoder._transformer_layers = layers


def encoder_embeddings(encoder, word_ids, type_ids, training):
    """BertEncoderV2's input to its first block [batch, length, hidden]: word, position and
    type embeddings, their layer norm, dropout (and projection), as its `call` makes them."""
    x = encoder._get_embeddings(word_ids, type_ids, encoder._embedding_layer(word_ids), None, None)
    x = encoder._embedding_dropout(encoder._embedding_norm_layer(x), training=training)
    return x if encoder._embedding_projection is None else encoder._embedding_projection(x)


def encoder_attention_mask(encoder, like, input_mask):
    """BertEncoderV2's attention mask [batch, length, length] of input_mask, in `like`'s dtype."""
    return encoder._attention_mask_layer(like, input_mask)


def encoder_input_layers(encoder) -> list:
    """BertEncoderV2's layers that run before its blocks (their weights: the first pipeline stage's)."""
    return [layer for layer in (encoder._embedding_layer, encoder._position_embedding_layer,
                                encoder._type_embedding_layer, encoder._embedding_norm_layer,
                                encoder._embedding_projection) if layer is not None]


def rename_layer(layer, name: str) -> None:
    """Sets a built-in layer's name (variable names, hence rule paths, follow it)."""
    layer._name = name


def set_embedding_initializer(embedding, initializer) -> None:
    """Model Garden's OnDeviceEmbedding: the initializer its table is made with (before it builds)."""
    embedding._initializer = initializer
