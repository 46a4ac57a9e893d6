"""The benches' baselines written as their users write them: each model in stock tf_keras
layers (`plain_keras_model`, trained by plain Keras `fit`), and the Llama network in KerasHub
(`run_keras_hub`: `keras_hub.models.LlamaCausalLM`, Keras 3 on the TensorFlow backend, `fit`;
run by bench/train_throughput.py in the Python that has keras_hub, --keras_hub_python)."""

from __future__ import annotations

import time


def plain_keras_model(task, cfg):
    """The model written with stock tf_keras layers only, as a Keras user writes it.

    gpt: GPT-2 pre-norm blocks of `MultiHeadAttention(use_causal_mask=True)`, `Dense` gelu
    MLP and `LayerNormalization`, `Embedding` token and position tables, and the output
    layer tied to the token table as Keras-NLP's ReversibleEmbedding ties it
    (`matmul(x, table, transpose_b=True)`): the same weights as models/gpt.py's GPT.
    bert: BERT's post-norm encoder from `Embedding` (word, position, token type),
    `LayerNormalization`, `MultiHeadAttention` masked by the input mask and a `Dense` gelu
    MLP; the masked-LM head gathers the masked positions (`tf.gather(batch_dims=1)`),
    transforms them (`Dense` gelu, `LayerNormalization`) and ties the output to the word
    table, with an output bias: the masked-LM weights of models/bert.py (its pooler and
    frozen next-sentence classifier aside).
    resnet: `tf_keras.applications.ResNet50(weights=None)` (v1: strides on the 1x1
    convolution; the same multiply-adds to within 1%).
    llama: `Embedding`, an RMSNorm layer (Keras has none), `Dense` query/key/value/output
    projections without biases, rotary positions and the repeat of key/value heads written
    with tf ops, `tf.nn.softmax` attention under a causal mask, a SwiGLU `Dense` MLP and an
    untied `Dense` output layer: models/llama.py's network and weight count.
    """
    import tensorflow as tf
    import tf_keras

    layers = tf_keras.layers
    init = lambda: tf_keras.initializers.TruncatedNormal(stddev=0.02)
    if task.name == "resnet":
        images = tf_keras.Input([cfg.image_size, cfg.image_size, 3], name="images")
        net = tf_keras.applications.ResNet50(weights=None, input_tensor=images, classes=cfg.num_classes,
                                             classifier_activation=None)
        return tf_keras.Model({"images": images}, net.output)
    if task.name == "bert":
        return _plain_keras_bert(cfg, init)
    if task.name == "llama":
        return _plain_keras_llama(cfg, init)

    class TiedOutput(layers.Layer):
        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def call(self, x):
            return tf.cast(tf.matmul(x, tf.cast(self.embedding.embeddings, x.dtype), transpose_b=True), tf.float32)

    class AddPositions(layers.Layer):  # a learned position table, added
        def build(self, shape):
            self.table = self.add_weight("embeddings", [cfg.seq_len, cfg.embed_dim], initializer=init())

        def call(self, x):
            return x + tf.cast(self.table, x.dtype)

    ids = tf_keras.Input([cfg.seq_len], dtype=tf.int32, name="inputs")
    token = layers.Embedding(cfg.vocab_size, cfg.embed_dim, embeddings_initializer=init())
    x = AddPositions()(token(ids))
    for _ in range(cfg.num_layers):
        h = layers.LayerNormalization(epsilon=cfg.norm_epsilon)(x)
        h = layers.MultiHeadAttention(cfg.num_heads, cfg.embed_dim // cfg.num_heads, kernel_initializer=init())(
            h, h, use_causal_mask=True)
        x = x + h
        h = layers.LayerNormalization(epsilon=cfg.norm_epsilon)(x)
        h = layers.Dense(cfg.mlp_dim, activation="gelu", kernel_initializer=init())(h)
        x = x + layers.Dense(cfg.embed_dim, kernel_initializer=init())(h)
    x = layers.LayerNormalization(epsilon=cfg.norm_epsilon)(x)
    return tf_keras.Model({"inputs": ids}, TiedOutput(token)(x))


def _plain_keras_bert(cfg, init):
    import tensorflow as tf
    import tf_keras

    layers = tf_keras.layers
    length, hidden = cfg.seq_len, cfg.hidden_size

    class AddPositions(layers.Layer):  # a learned position table, added
        def build(self, shape):
            self.table = self.add_weight("embeddings", [length, hidden], initializer=init())

        def call(self, x):
            return x + tf.cast(self.table, x.dtype)

    class MaskedLMOutput(layers.Layer):  # gather the masked positions; logits tied to the word table
        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def build(self, shape):
            self.bias = self.add_weight("bias", [cfg.vocab_size], initializer="zeros")

        def call(self, x):
            table = tf.cast(self.embedding.embeddings, x.dtype)
            return tf.cast(tf.einsum("bph,vh->bpv", x, table) + tf.cast(self.bias, x.dtype), tf.float32)

    names = ("input_ids", "input_mask", "segment_ids")
    ids, mask, types = (tf_keras.Input([length], dtype=tf.int32, name=n) for n in names)
    positions = tf_keras.Input([cfg.max_predictions], dtype=tf.int32, name="masked_lm_positions")
    word = layers.Embedding(cfg.vocab_size, hidden, embeddings_initializer=init())
    x = AddPositions()(word(ids)) + layers.Embedding(cfg.type_vocab_size, hidden, embeddings_initializer=init())(types)
    x = layers.Dropout(cfg.dropout)(layers.LayerNormalization(epsilon=1e-12)(x))
    attend = layers.Lambda(lambda m: tf.cast(m[:, None, :], tf.bool) & tf.ones([1, length, 1], tf.bool))(mask)
    for _ in range(cfg.num_layers):
        h = layers.MultiHeadAttention(cfg.num_heads, hidden // cfg.num_heads, dropout=cfg.attention_dropout,
                                      kernel_initializer=init())(x, x, attention_mask=attend)
        x = layers.LayerNormalization(epsilon=1e-12)(x + layers.Dropout(cfg.attention_dropout)(h))
        h = layers.Dense(cfg.intermediate_size, activation="gelu", kernel_initializer=init())(x)
        h = layers.Dense(hidden, kernel_initializer=init())(h)
        x = layers.LayerNormalization(epsilon=1e-12)(x + layers.Dropout(cfg.dropout)(h))
    picked = layers.Lambda(lambda a: tf.gather(a[0], a[1], batch_dims=1))([x, positions])
    picked = layers.LayerNormalization(epsilon=1e-12)(
        layers.Dense(hidden, activation="gelu", kernel_initializer=init())(picked))
    inputs = {"input_ids": ids, "input_mask": mask, "segment_ids": types, "masked_lm_positions": positions}
    return tf_keras.Model(inputs, MaskedLMOutput(word)(picked))




def _plain_keras_llama(cfg, init):
    import numpy as np
    import tensorflow as tf
    import tf_keras

    layers = tf_keras.layers
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.embed_dim // cfg.num_heads
    inverse = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    angles = np.arange(cfg.seq_len)[:, None] * inverse[None, :]  # [length, d / 2]

    class RMSNorm(layers.Layer):
        def build(self, shape):
            self.scale = self.add_weight("scale", [shape[-1]], initializer="ones")

        def call(self, x):
            xf = tf.cast(x, tf.float32)
            y = xf * tf.math.rsqrt(tf.reduce_mean(tf.square(xf), -1, keepdims=True) + cfg.norm_epsilon)
            return tf.cast(y, x.dtype) * tf.cast(self.scale, x.dtype)

    def rotate(x):  # [batch, length, heads, d]
        cos, sin = (tf.cast(f(angles)[None, :, None, :], x.dtype) for f in (np.cos, np.sin))
        x1, x2 = tf.split(x, 2, axis=-1)
        return tf.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def attention(q, k, v):
        q, k, v = rotate(q), rotate(k), v
        k, v = (tf.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
        scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * tf.cast(d ** -0.5, q.dtype)
        causal = tf.linalg.band_part(tf.ones([cfg.seq_len, cfg.seq_len], tf.bool), -1, 0)
        scores = tf.where(causal, scores, tf.cast(-1e9, scores.dtype))
        out = tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores, axis=-1), v)
        return tf.reshape(out, [-1, cfg.seq_len, heads * d])

    dense = lambda n: layers.Dense(n, use_bias=False, kernel_initializer=init())
    ids = tf_keras.Input([cfg.seq_len], dtype=tf.int32, name="inputs")
    x = layers.Embedding(cfg.vocab_size, cfg.embed_dim, embeddings_initializer=init())(ids)
    for _ in range(cfg.num_layers):
        h = RMSNorm()(x)
        q = layers.Reshape([cfg.seq_len, heads, d])(dense(heads * d)(h))
        k = layers.Reshape([cfg.seq_len, kv_heads, d])(dense(kv_heads * d)(h))
        v = layers.Reshape([cfg.seq_len, kv_heads, d])(dense(kv_heads * d)(h))
        x = x + dense(cfg.embed_dim)(layers.Lambda(lambda t: attention(*t))([q, k, v]))
        h = RMSNorm()(x)
        x = x + dense(cfg.embed_dim)(tf.nn.silu(dense(cfg.mlp_dim)(h)) * dense(cfg.mlp_dim)(h))
    logits = layers.Dense(cfg.vocab_size, use_bias=False, kernel_initializer=init(), dtype="float32")(RMSNorm()(x))
    return tf_keras.Model({"inputs": ids}, logits)


def run_keras_hub(args, task, cfg, batches) -> dict:
    """KerasHub's `LlamaCausalLM` (no preprocessor) of the same shape, compiled with Keras 3's
    AdamW (the same learning rate, beta_2 0.95, global-norm clipping 1.0) and the sparse
    cross-entropy on the targets weighted like tfpod's loss, `fit` on the same batches;
    per-step times from a callback. Its weights: the same count (`parameters`)."""
    import os

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(args.precision)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=cfg.vocab_size, num_layers=cfg.num_layers, num_query_heads=cfg.num_heads,
        hidden_dim=cfg.embed_dim, intermediate_dim=cfg.mlp_dim, num_key_value_heads=cfg.num_kv_heads,
        rope_max_wavelength=cfg.rope_theta, layer_norm_epsilon=cfg.norm_epsilon, dropout=0.0)
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    optimizer = keras.optimizers.AdamW(learning_rate=args.learning_rate, beta_2=0.95, weight_decay=0.01,
                                       global_clipnorm=1.0)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    data = tf.data.Dataset.from_tensor_slices(stacked).map(
        lambda b: ({"token_ids": b["inputs"], "padding_mask": tf.ones_like(b["inputs"], tf.bool)}, b["targets"],
                   b["weights"])).repeat().prefetch(2)
    ends = []

    class Times(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    history = model.fit(data, epochs=1, steps_per_epoch=args.warmup + args.steps, callbacks=[Times()], verbose=0)
    return {"start": ends[args.warmup - 1], "end": ends[-1], "loss": float(history.history["loss"][-1]),
            "parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
            "model": f"keras_hub {keras_hub.__version__} LlamaCausalLM, keras {keras.__version__}"}
