"""Training on 8 logical CPU devices: sharded meshes against one device, resume, options."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from conftest import device_mesh, make_run
from tfpod import UserError, optimizers
from tfpod.api import run
from tfpod.controller import Controller, TrainConfig
from tfpod.mesh import make_mesh
from tfpod.models import gpt
SMALL = dict(vocab_size=256, seq_len=32, num_layers=1, embed_dim=64, num_heads=8, mlp_dim=128)


def train(model_dir, mesh, steps=4, preset="tensor", model=None, opt=None, **train_kw):
    cfg = gpt.GPTConfig(**{**SMALL, **(model or {})})
    kw = dict(steps=steps, global_batch_size=16, steps_per_loop=2, log_every=2, checkpoint_every=100,
              synthetic_data=True, seed=1)
    kw.update(train_kw)
    opt_cfg = optimizers.OptimizerConfig(**{"learning_rate": 1e-2, "warmup_steps": 0, "decay_steps": 8, **(opt or {})})
    controller = make_run(gpt.TASK, cfg, TrainConfig(**kw), opt_cfg, mesh, model_dir, preset=preset)
    return controller.trainer, controller.train()


# The same small LM as gin bindings, for runs through main.py.
SMALL_PARAMS = [f"gpt.{k}={v}" for k, v in SMALL.items()] + [
    "train.steps=4", "train.global_batch_size=16", "train.steps_per_loop=2", "train.log_every=1", "train.seed=1",
    "train.checkpoint_every=100", "optimizer.learning_rate=0.01", "optimizer.warmup_steps=0",
    "optimizer.decay_steps=8", "sharding.preset='tensor'", "train.synthetic_data=True",
]


@pytest.mark.unit
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_norm_gpt", "post_norm_bert"])
def test_block_equals_model_gardens_transformer_encoder_block(norm_first):
    """gpt.Block (2-D matmuls) computes Model Garden's TransformerEncoderBlock with the same
    weights, names and dropout rates, pre-norm (GPT) and post-norm (BERT), under a padding mask."""
    import tf_keras
    from official.nlp.modeling import layers as mg

    cfg = gpt.GPTConfig(vocab_size=64, seq_len=8, num_layers=1, embed_dim=32, num_heads=4, mlp_dim=64,
                        dropout=0.1, attention_dropout=0.2, norm_epsilon=1e-12)
    init = lambda: tf_keras.initializers.TruncatedNormal(stddev=0.3)
    ours = gpt.Block(cfg, init, norm_first=norm_first, activation=tf_keras.activations.get("gelu"), name="b")
    theirs = mg.TransformerEncoderBlock(num_attention_heads=4, inner_dim=64, inner_activation="gelu",
                                        norm_first=norm_first, norm_epsilon=1e-12, output_dropout=0.1,
                                        attention_dropout=0.2, kernel_initializer=init(), name="b")
    x = tf.random.stateless_normal([2, 8, 32], seed=[1, 2])
    mask = gpt.causal_mask(tf.zeros([2, 8], tf.int32)) * tf.constant([[1.0] * 8, [1.0] * 5 + [0.0] * 3])[:, None, :]
    ours([x, mask]), theirs([x, mask])
    assert sorted(v.name for v in ours.weights) == sorted(v.name for v in theirs.weights)
    by_name = {v.name: v for v in theirs.weights}
    for v in ours.weights:
        v.assign(by_name[v.name])
    np.testing.assert_allclose(ours([x, mask]).numpy(), theirs([x, mask]).numpy(), rtol=1e-5, atol=1e-5)
    assert (ours.attention_dropout.rate, ours.output_dropout.rate) == (
        theirs._attention_dropout.rate, theirs._output_dropout.rate)


def test_meshes_give_the_single_device_loss(tmp_path):
    """Same seed and global batch: every mesh's losses match one device's (relative 1e-3).

    The reference runs on one of this process's devices (a process with one CPU device,
    main.py's --cpu_devices=1, gives the same eval metrics: test_eval evaluates there).
    """
    ref_dir = tmp_path / "one"
    run(["gin/lm_tiny.gin"], SMALL_PARAMS, str(ref_dir), mesh=device_mesh())
    records = [json.loads(l) for l in open(ref_dir / "metrics.jsonl")]
    ref_losses = np.array([r["loss"] for r in records if r["kind"] == "train"])
    assert len(ref_losses) == 4 and np.ptp(ref_losses) > 1e-3  # the weights moved
    for spec in ["data:8", "data:2,model:4"]:  # (data:4,model:2 against data:8: test_presets)
        out = run(["gin/lm_tiny.gin"], SMALL_PARAMS, str(tmp_path / spec.replace(":", "").replace(",", "_")), mesh_spec=spec)
        rel = np.abs(np.array(out["losses"]) - ref_losses) / np.abs(ref_losses)
        assert rel.max() < 1e-3, (spec, out["losses"], ref_losses)


def test_tensor_preset_shards_weights_logs_metrics_and_bf16_stays_close(tmp_path):
    trainer, fp32 = train(tmp_path / "fp32", make_mesh("data:2,model:4"), steps=4)
    kernel = trainer.model.blocks[0].intermediate.kernel
    assert dtensor.fetch_layout(kernel).sharding_specs == [dtensor.UNSHARDED, "model"]
    assert dtensor.unpack(kernel.read_value())[0].shape == (64, 128 // 4)
    slot = trainer.optimizer.get_slot(kernel, "m")
    assert dtensor.fetch_layout(slot).sharding_specs == [dtensor.UNSHARDED, "model"]

    records = [json.loads(l) for l in open(tmp_path / "fp32" / "metrics.jsonl")]
    records = [r for r in records if r["kind"] != "goodput"]  # (the run's goodput summary: test_goodput)
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert r["kind"] == "train"
        for key, kind in [("step", int), ("loss", float), ("tokens_per_sec", float), ("examples_per_sec", float),
                          ("mfu", float), ("time", float)]:
            assert isinstance(r[key], kind), key
        assert r["tokens_per_sec"] == pytest.approx(r["examples_per_sec"] * 32)
        assert 0 < r["mfu"] < 1
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "fp32" / "train"))
    assert "gpt/block_0/intermediate/kernel" in open(tmp_path / "fp32" / "layouts.txt").read()

    # bf16 compute (another mesh: the meshes agree to 1e-3, far inside bf16's error)
    _, bf16 = train(tmp_path / "bf16", make_mesh("data:4,model:2"), steps=2, precision="mixed_bfloat16")
    np.testing.assert_allclose(bf16["losses"], fp32["losses"][:2], rtol=3e-2)
    assert bf16["losses"] != fp32["losses"][:2]  # really computed in bf16


def test_the_train_loop_compiles_once_and_checkpoints_keep_the_last_n(tmp_path, caplog):
    """Calls of 2, 2 and 1 steps (a partial stack), then a resumed run's calls of 1 and 1 on the
    same Trainer, reuse one trace: no recompiling. Checkpoints come every 2 steps and at the
    end; the newest 2 are kept.

    Under `data` the vocab rows are whole on every device, so the embedding is a gather
    (its gradient densified); under `tensor` (the other tests) a one-hot matmul.
    """
    import logging

    mesh = device_mesh("data:1")  # compiling once is the point: one device
    kw = dict(preset="data", log_every=2, checkpoint_every=2, keep_checkpoints=2)
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        trainer, out = train(tmp_path, mesh, steps=5, **kw)
    assert len(out["losses"]) == 5 and trainer.traces == 1
    assert "traced again" not in caplog.text
    assert trainer.model.token_embedding._use_one_hot is False
    checkpoints = lambda: sorted(f for f in os.listdir(tmp_path / "checkpoints") if f.endswith(".index"))
    assert checkpoints() == ["ckpt-4.index", "ckpt-5.index"]
    resumed = Controller(trainer, TrainConfig(steps=7, global_batch_size=16, steps_per_loop=2, log_every=2,
                                              checkpoint_every=2, keep_checkpoints=2, synthetic_data=True, seed=1),
                         str(tmp_path))
    out = resumed.train()  # resumes at 5 (ckpt-5): calls of 1 and 1
    assert out["step"] == 7 and len(out["losses"]) == 2 and trainer.traces == 1
    assert checkpoints() == ["ckpt-6.index", "ckpt-7.index"]


@pytest.mark.parametrize("name,lr", [("lamb", 5e-3), ("lars", 0.5)])  # (adamw: the other tests)
def test_other_optimizers_train(tmp_path, name, lr):
    """Each Model Garden optimizer updates the sharded weights, its slots laid out like them."""
    trainer, out = train(tmp_path, device_mesh("data:1,model:2"), steps=2, opt={"name": name, "learning_rate": lr},
                         checkpoint_every=1)
    assert np.all(np.isfinite(out["losses"]))
    kernel = trainer.model.blocks[0].intermediate.kernel
    before = tf.train.load_variable(str(tmp_path / "checkpoints" / "ckpt-1"),
                                    "model/blocks/0/intermediate/kernel/.ATTRIBUTES/VARIABLE_VALUE")
    mesh = trainer.placement.mesh
    after = dtensor.unpack(dtensor.relayout(kernel.read_value(), dtensor.Layout.replicated(mesh, 2)))[0]
    assert np.abs(after.numpy() - before).max() > 0  # step 2 moved the weights
    slots = optimizers.slot_variables(trainer.optimizer)
    assert slots and all(dtensor.fetch_layout(s).mesh == mesh for s in slots)


def test_batch_must_divide_over_data_axis(tmp_path):
    with pytest.raises(UserError, match="global_batch_size=12 does not divide over mesh axis 'data' of size 8"):
        train(tmp_path, make_mesh("data:8"), global_batch_size=12)
