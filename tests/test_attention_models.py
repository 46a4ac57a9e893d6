"""Blockwise attention in every model that attends (issue 43): attention dropout through the
kernel, every other dropout on (one device and a mesh alike, replayed by a resumed run and
by recomputation), BERT and the Transformer (padding as key masks, causal decoder,
cross-attention) and a Keras MultiHeadAttention trained with fit: the materialized path's
losses (relative 1e-5, fp32)."""

import dataclasses
import logging

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tfpod
from conftest import device_mesh, make_run
from tfpod import attention, compat, optimizers
from tfpod.controller import TrainConfig
from tfpod.models import bert, gpt, transformer


def train(task, config, mesh, model_dir, steps=3, implementation="blockwise", block_size=8, preset=None,
          checkpoint_every=100, **train):
    """Losses of `steps` steps (one compiled loop) from seed 1 on synthetic batches, every
    dropout layer on at its config's rate."""
    cfg = TrainConfig(steps=steps, global_batch_size=8, steps_per_loop=steps, log_every=1,
                      checkpoint_every=checkpoint_every, synthetic_data=True, seed=1, **train)
    opt = optimizers.OptimizerConfig(name="sgd", learning_rate=0.1, warmup_steps=0, decay_steps=8, weight_decay=0.0)
    run = make_run(task, config, cfg, opt, device_mesh(mesh), model_dir, preset=preset,
                   attention=attention.AttentionConfig(implementation, block_size))
    return run.train()["losses"]


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_cross_attention_with_key_padding_and_dropout_equals_the_materialized_matrix(jit):
    """Queries and keys of different lengths, keys padded, queries all of one segment, dropout:
    outputs and q, k, v gradients within 1e-6 of the materialized matrix with the same keep
    masks, in graph mode and under XLA."""
    rng = np.random.default_rng(0)
    q = tf.constant(rng.normal(size=(2, 3, 20, 8)), tf.float32)
    k, v = (tf.constant(rng.normal(size=(2, 3, 28, 8)), tf.float32) for _ in range(2))
    keys = np.ones((2, 28), np.int32)
    keys[0, 21:] = keys[1, 9:] = 0
    q_ids, k_ids, seed = tf.ones((2, 20), tf.int32), tf.constant(keys), tf.constant([3, 5], tf.int64)
    keep = attention.dropout_keep(seed, [2, 3, 20, 28], 0.25, 8)
    weights = tf.constant(rng.normal(size=(2, 3, 20, 8)), tf.float32)

    @tf.function(jit_compile=jit)
    def both(q, k, v):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([q, k, v])
            one = attention.blockwise(q, k, v, q_ids, k_ids, False, 8, 0.25, seed)
            two = attention.materialized(q, k, v, q_ids, k_ids, False, keep)
            losses = tf.reduce_sum(one * weights), tf.reduce_sum(two * weights)
        return [one, *tape.gradient(losses[0], [q, k, v])], [two, *tape.gradient(losses[1], [q, k, v])]

    got, want = both(q, k, v)
    assert max(float(tf.reduce_max(tf.abs(a - b)) / tf.reduce_max(tf.abs(b))) for a, b in zip(got, want)) < 1e-6
    dropped = 1.0 - float(tf.reduce_mean(tf.cast(keep > 0, tf.float32)))
    assert 0.2 < dropped < 0.3  # the hash draws uniforms


GPT = gpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=1, embed_dim=32, num_heads=4, mlp_dim=64, dropout=0.1,
                    attention_dropout=0.2)


def test_gpt_attention_dropout_runs_in_the_kernel_alike_on_a_mesh_resumed_and_recomputed(tmp_path):
    """GPT with every dropout on: attention dropout 0.2 in the kernel (block 8: 4 x 4 blocks a
    row) and on the attention output, dropout 0.1 on the residual stream (Keras dropouts): the
    Megatron `tensor` layout on data:2,model:4 with recomputed blocks (remat) trains one
    device's losses (relative 1e-5: every mask, the kernel's and Keras's, is a hash of each
    element's global index, equal whatever the layout, and the recomputation draws the same
    masks); a run stopped after 2 steps and resumed trains the third step's loss exactly."""
    one = train(gpt.TASK, GPT, "data:1", tmp_path / "one")
    mesh = train(gpt.TASK, dataclasses.replace(GPT, remat=True), "data:2,model:4", tmp_path / "mesh", preset="tensor")
    np.testing.assert_allclose(mesh, one, rtol=1e-5)
    train(gpt.TASK, GPT, "data:1", tmp_path / "resumed", steps=2, checkpoint_every=2)
    resumed = train(gpt.TASK, GPT, "data:1", tmp_path / "resumed", steps=3, checkpoint_every=2)
    assert resumed == one[2:]


def test_bert_trains_the_materialized_losses_blockwise(tmp_path):
    """BERT (padded examples: a key mask [batch, 1, length]) on the `tensor` layout,
    data:2,model:2: blockwise (block 8, several blocks a row) gives the materialized path's
    losses step by step (relative 1e-5)."""
    config = bert.BertConfig(vocab_size=128, seq_len=32, max_predictions=5, num_layers=2, hidden_size=32, num_heads=4,
                             intermediate_size=64, dropout=0.0, attention_dropout=0.0, next_sentence=True)
    losses = {impl: train(bert.TASK, config, "data:2,model:2", tmp_path / impl, implementation=impl, preset="tensor")
              for impl in ("materialized", "blockwise")}
    np.testing.assert_allclose(losses["blockwise"], losses["materialized"], rtol=1e-5)


def test_the_transformer_attends_blockwise_with_the_materialized_logits_and_gradients():
    """The Transformer's encoder self-attention and cross-attention (padded sources: key
    masks), causal decoder self-attention, source and target of different lengths: one model,
    traced once per implementation (graph mode), gives the materialized path's logits and
    weight gradients of a loss over the real targets (relative 1e-5; block 8: several blocks
    a row). (Trained by the trainer, the two implementations start from other initial
    weights: Keras's path of the stand-ins draws its variables in another order.)"""
    config = transformer.TransformerConfig(vocab_size=128, src_len=24, tgt_len=16, encoder_layers=1, decoder_layers=2,
                                           hidden_size=32, num_heads=4, intermediate_size=64, dropout=0.0,
                                           attention_dropout=0.0, intermediate_dropout=0.0)
    tf_keras.utils.set_random_seed(0)
    model = transformer.TASK.build(config)
    batch = transformer.synthetic_batch(config, 4, np.random.default_rng(0))
    assert (batch["inputs"] == 0).any()  # padded sources
    inputs = transformer.model_inputs(batch)
    weights = np.random.default_rng(1).normal(size=(4, 16, 128)) * batch["weights"][:, :, None]
    results = {}
    for impl in ("materialized", "blockwise"):

        @tf.function
        def step(inputs):
            with tf.GradientTape() as tape:
                logits = model(inputs, training=True)
                loss = tf.reduce_sum(logits * tf.constant(weights, tf.float32))
            return [logits] + tape.gradient(loss, model.trainable_variables)

        with attention.using(attention.AttentionConfig(impl, 8)):  # (a step traced outside a placement)
            results[impl] = step(inputs)
    for got, want, name in zip(results["blockwise"], results["materialized"],
                               ["logits"] + [v.name for v in model.trainable_variables]):
        if "key/bias" not in name:  # (zero gradients: a key bias adds a constant to a query's scores)
            assert float(tf.reduce_max(tf.abs(got - want)) / tf.reduce_max(tf.abs(want))) < 1e-5, name
    assert "MultiHeadAttention" in {type(layer).__name__ for layer in compat.flatten_layers(model)}


def test_transformer_attention_dropout_in_the_kernel_is_one_devices_on_a_mesh(tmp_path):
    """The Transformer's three attentions (Keras MultiHeadAttention and Model Garden's
    CachedAttention stand-ins) drop their probabilities in the kernel, and its Keras dropouts
    (attention outputs, residual stream, feed-forward: every rate on) drop theirs:
    data:2,model:2 (`tensor`) trains one device's losses (relative 1e-5)."""
    config = transformer.TransformerConfig(vocab_size=128, src_len=24, tgt_len=16, encoder_layers=1, decoder_layers=1,
                                           hidden_size=32, num_heads=4, intermediate_size=64, dropout=0.1,
                                           attention_dropout=0.3, intermediate_dropout=0.1)
    one = train(transformer.TASK, config, "data:1", tmp_path / "one")
    mesh = train(transformer.TASK, config, "data:2,model:2", tmp_path / "mesh", preset="tensor")
    np.testing.assert_allclose(mesh, one, rtol=1e-5)


def _keras_model(seed: int):
    """ids [batch, 12] (0: padding) -> an Embedding with mask_zero, two MultiHeadAttentions (the
    second causal) and one that returns its scores (Keras's path), masked mean, 3 classes."""
    tf_keras.utils.set_random_seed(seed)
    layers = tf_keras.layers
    ids = tf_keras.Input((12,), dtype="int32")
    x = layers.Embedding(20, 16, mask_zero=True, name="embed")(ids)
    x = layers.Add()([x, layers.MultiHeadAttention(4, 4, name="mha")(x, x)])  # (Add keeps the mask; `+` drops it)
    x = layers.Add()([x, layers.MultiHeadAttention(4, 4, name="causal")(x, x, use_causal_mask=True)])
    scored, _ = layers.MultiHeadAttention(2, 4, name="scored")(x, x, return_attention_scores=True)
    x = layers.GlobalAveragePooling1D()(layers.Add()([x, scored]))  # over the real tokens (the mask)
    return tf_keras.Model(ids, layers.Dense(3, name="head")(x))


def test_keras_multi_head_attention_trains_the_materialized_losses_under_fit(caplog):
    """A user's model through the Keras front end on data:2,model:2 (heads split over `model`):
    compile swaps its MultiHeadAttentions for the blockwise stand-ins (padding from the
    Embedding's mask, a causal one; block 4) and fit trains the losses of Keras's own
    materialized attention; the layer that returns its scores keeps Keras's path, said in
    one log line."""
    mesh = device_mesh("data:2,model:2")
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 20, (32, 12)).astype(np.int32)
    for row, n in enumerate(rng.integers(3, 13, 32)):
        ids[row, n:] = 0
    labels = rng.integers(0, 3, 32).astype(np.int32)
    rules = {r".*(query|key|value)_dense\.kernel": (None, "model", None),
             r".*(query|key|value)_dense\.bias": ("model", None),
             r".*output_dense\.kernel": ("model", None, None)}
    losses = {}
    for impl in ("materialized", "blockwise"):
        with tfpod.sharding(mesh, rules=rules, attention=attention.AttentionConfig(impl, 4)):
            model = _keras_model(0)
        with caplog.at_level(logging.INFO, logger="tfpod"):
            caplog.clear()
            model.compile(optimizer=tf_keras.optimizers.SGD(0.1),
                          loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            data = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(8, drop_remainder=True)
            losses[impl] = model.fit(tfpod.input.to_mesh(data, mesh), epochs=2, verbose=0).history["loss"]
        notes = [r.getMessage() for r in caplog.records if "attends materialized" in r.getMessage()]
        assert notes == ([] if impl == "materialized" else [
            f"model {model.name!r}: attention layer 'scored' attends materialized (Keras's path): "
            "return_attention_scores=True"])
        assert type(model.get_layer("mha")).__module__ == "tfpod.attention_layers"
    np.testing.assert_allclose(losses["blockwise"], losses["materialized"], rtol=1e-5)
