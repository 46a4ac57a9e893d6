"""Gradient accumulation (`train.microbatches` without a `stage` axis): every model's
accumulated steps give the losses of its unsplit steps.

Each run trains 2 steps in one compiled call (steps_per_loop=2) on 2 of the 8 devices
(`data:2`: each microbatch split over the batch axis like the batch) from the same seed and
batches, once whole and once in microbatches; the second step's loss shows the update was
the whole batch's too. Relative 1e-5: the microbatch sums add in another order.

What makes it exact: a task's loss is sums over the rows, each divided by its count over
the whole step (`Task.loss_terms`, `Task.loss_counts`), plus an aux term that is already a
mean (MoE's load balancing, SSD's weight decay) shared equally. BERT's two terms have
counts that differ between microbatches (real predictions per row vary), so averaging the
microbatches' own losses would not give the batch's. Batch norm normalizes each microbatch
in training, which is what accumulation means for it (the docs say so); here ResNet and SSD
run their batch norm in inference mode so the comparison is exact.
"""

import dataclasses

import numpy as np
import pytest

from conftest import device_mesh, make_run
from tfpod import optimizers
from tfpod.controller import TrainConfig
from tfpod.executor import OneMesh
from tfpod.models import bert, gpt, moe, resnet, ssd, transformer
from tfpod.task import LossTerms


class InferenceNorm:
    """A task whose batch norm uses its moving statistics in the train step (no dropout in these
    configs either); SSD's weight decay added as its aux term as training adds it."""

    def loss_terms(self, model, batch, training):
        terms = super().loss_terms(model, batch, False)
        if isinstance(self, ssd.SSDTask):
            return LossTerms(terms.sums, aux=model.config.weight_decay * ssd.l2_penalty(model), metrics=terms.metrics)
        return terms


class ResNetInference(InferenceNorm, resnet.ResNetTask):
    pass


class SSDInference(InferenceNorm, ssd.SSDTask):
    pass


CASES = {
    "moe": (moe.TASK, moe.MoEConfig(vocab_size=256, seq_len=32, num_layers=2, embed_dim=32, num_heads=4, mlp_dim=64,
                                    num_experts=4, expert_mlp_dim=32, moe_every=2, group_size=16), 4),
    "bert": (bert.TASK, bert.BertConfig(vocab_size=128, seq_len=32, max_predictions=5, num_layers=1, hidden_size=32,
                                        num_heads=4, intermediate_size=64, dropout=0.0, attention_dropout=0.0,
                                        next_sentence=True), 4),
    "transformer": (transformer.TASK, transformer.TransformerConfig(
        vocab_size=256, src_len=16, tgt_len=8, encoder_layers=1, decoder_layers=1, hidden_size=32, num_heads=4,
        intermediate_size=64, dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0), 2),
    "resnet": (ResNetInference(), resnet.ResNetConfig(depth=10, depth_multiplier=0.25, image_size=32, num_classes=10), 2),
    "ssd": (SSDInference(), ssd.SSDConfig(num_classes=4, image_size=64, depth_multiplier=0.25, block_repeats=(1, 1, 1),
                                          num_feature_maps=4), 2),
}


def train(task, config, microbatches, model_dir):
    cfg = TrainConfig(steps=2, global_batch_size=8, steps_per_loop=2, log_every=2, checkpoint_every=100,
                      synthetic_data=True, seed=1, microbatches=microbatches)
    opt = optimizers.OptimizerConfig(name="sgd", learning_rate=0.1, warmup_steps=0, decay_steps=8, weight_decay=0.0)
    run = make_run(task, config, cfg, opt, device_mesh("data:2"), model_dir)
    return run, run.train()["losses"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_microbatches_give_the_unsplit_batchs_losses(tmp_path, name):
    task, config, microbatches = CASES[name]
    _, whole = train(task, config, 1, tmp_path / "whole")
    run, split = train(task, config, microbatches, tmp_path / "split")
    assert len(whole) == len(split) == 2 and whole[0] != whole[1]
    np.testing.assert_allclose(split, whole, rtol=1e-5)
    assert isinstance(run.trainer.executor, OneMesh)
    assert run.trainer.traces == 1  # one compiled loop: steps_per_loop holds


def test_recomputed_blocks_replay_each_microbatchs_dropout_masks(tmp_path):
    """gpt.remat=True with dropout over 2 microbatches trains the losses of keeping the activations:
    a recomputed block, run again in the backward pass, draws its own microbatch's masks."""
    config = gpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=2, embed_dim=32, num_heads=4, mlp_dim=64,
                           dropout=0.1, attention_dropout=0.1)
    _, kept = train(gpt.TASK, config, 2, tmp_path / "kept")
    _, recomputed = train(gpt.TASK, dataclasses.replace(config, remat=True), 2, tmp_path / "remat")
    assert kept[0] != kept[1]
    np.testing.assert_allclose(recomputed, kept, rtol=1e-6)


@pytest.mark.unit
def test_the_one_update_clips_as_tensorflow_does_and_accumulation_adds_by_variable():
    """One mesh's clipping (GradientHomes' scale, Update.scaled) is tf.clip_by_global_norm's to the
    bit, a non-finite norm makes every scale NaN (the step is then skipped), and Accumulation.add
    adds each gradient to its own variable's entry (None: nothing yet, or nothing to add)."""
    import tensorflow as tf

    from tfpod.executor import Accumulation

    grads = [tf.constant([[0.3, -1.7], [2.9, 0.01]]), tf.constant([4.1, -0.6, 1e-3])]
    homes = optimizers.GradientHomes()
    norm = homes.global_norm(grads)
    clipped = optimizers.Update.scaled(grads, homes.clip_scales(grads, norm, 0.7))
    expected, expected_norm = tf.clip_by_global_norm(grads, 0.7)
    assert norm.numpy() == expected_norm.numpy()
    for got, want in zip(clipped, expected):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    bad = [grads[0], tf.constant([np.inf, 0.0, 0.0])]
    assert all(np.isnan(s.numpy()) for s in homes.clip_scales(bad, homes.global_norm(bad), 0.7))
    assert not homes.all_finite(tf.constant(1.0), homes.global_norm(bad)).numpy()

    a, b, c = tf.constant(1.0), tf.constant(2.0), tf.constant(4.0)
    total = Accumulation.add([None, a, None], [b, c])
    assert total[0] is b and total[1].numpy() == 5.0 and total[2] is None
    total = Accumulation.add(total, [c, None], indices=[2, 0])
    assert total[2] is c and total[0] is b
