"""GShard MoE LM: gating against a numpy reference, expert-sharded runs against data parallel, main.py."""

import json
import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from conftest import assert_golden_layouts, make_run
from tfpod import UserError, optimizers, partitioning
from tfpod.api import run
from tfpod.mesh import make_mesh
from tfpod.models import moe
from tfpod.controller import TrainConfig

U = dtensor.UNSHARDED
# 2 blocks (block_1 is MoE), 4 routing groups of 8 tokens per sequence, capacity 2 per
# group and expert (factor 1.0), so tokens are dropped.
SMALL = dict(vocab_size=256, seq_len=32, num_layers=2, embed_dim=64, num_heads=8, mlp_dim=128, num_experts=8,
             expert_mlp_dim=64, group_size=8, capacity_factor=1.0, min_capacity=2)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_gating(logits, capacity):
    """GShard Algorithm 1, token by token: (combine, dispatch, aux_loss) as numpy arrays."""
    batch, groups, size, experts = logits.shape
    gates = softmax(logits.astype(np.float64))
    combine = np.zeros((batch, groups, size, experts, capacity))
    dispatch = np.zeros_like(combine)
    aux = 0.0
    for b in range(batch):
        for g in range(groups):
            p = gates[b, g]  # [size, experts]
            first = p.argmax(-1)
            second = np.where(np.eye(experts)[first] > 0, -np.inf, p).argmax(-1)
            norm = p[np.arange(size), first] + p[np.arange(size), second]
            filled = np.zeros(experts, int)
            for choice in (first, second):  # all first choices take slots before any second
                for s in range(size):
                    e = choice[s]
                    if filled[e] < capacity:
                        combine[b, g, s, e, filled[e]] = p[s, e] / norm[s]
                        dispatch[b, g, s, e, filled[e]] = 1.0
                        filled[e] += 1
            fraction = np.bincount(first, minlength=experts) / size
            aux += np.mean(fraction * p.mean(0)) * experts**2
    return combine, dispatch, aux / (batch * groups)


@pytest.mark.unit
def test_top2_gating_matches_the_reference():
    logits = np.random.default_rng(0).normal(size=(2, 3, 16, 4)).astype(np.float32) * 2
    capacity = 3  # 16 tokens x 2 choices over 4 experts: an even split needs 8, so many drop
    combine, dispatch, aux = moe.top2_gating(tf.constant(logits), capacity)
    ref_combine, ref_dispatch, ref_aux = reference_gating(logits, capacity)
    np.testing.assert_allclose(combine.numpy(), ref_combine, atol=1e-6)
    np.testing.assert_array_equal(dispatch.numpy(), ref_dispatch)
    np.testing.assert_allclose(aux.numpy(), ref_aux, rtol=1e-5)
    assert ref_dispatch.sum() < 2 * 16 * 2 * 3  # some choices were dropped
    assert ref_dispatch.sum(axis=2).max() == 1  # each slot of an expert holds at most one token
    # Without drops each token's two gates sum to 1.
    combine, dispatch, _ = moe.top2_gating(tf.constant(logits), 32)
    np.testing.assert_allclose(combine.numpy().sum(axis=(3, 4)), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(dispatch.numpy().sum(axis=(3, 4)), 2.0)
    # Uniform gates give the aux loss 1.
    _, _, uniform = moe.top2_gating(tf.zeros([2, 3, 16, 4]), capacity)
    assert uniform.numpy() == pytest.approx(1.0)


@pytest.mark.unit
def test_capacity_and_flops():
    assert moe.expert_capacity(16, 8, 2.0, 4) == 8 and moe.expert_capacity(8, 8, 1.0, 4) == 4
    cfg = moe.MoEConfig(**SMALL)
    assert cfg.capacity == 2 and cfg.num_moe_blocks == 1 and [cfg.is_moe_block(i) for i in range(2)] == [False, True]
    # A token uses its top 2 experts: more experts only widen the router.
    more = moe.MoEConfig(**{**SMALL, "num_experts": 16})
    assert moe.flops_per_token(more) - moe.flops_per_token(cfg) == 6 * 64 * 8


@pytest.mark.unit
def test_aux_loss_is_in_the_training_loss_and_reaches_the_router():
    """Plain Keras, one device: loss = lm + coef * aux; the aux gradient reaches the router, also with remat."""
    cfg = moe.MoEConfig(**{**SMALL, "aux_loss_coef": 0.5})
    batch = {k: tf.constant(v) for k, v in moe.TASK.synthetic_batch(cfg, 4, np.random.default_rng(0)).items()}
    tf_keras.utils.set_random_seed(0)
    model = moe.TASK.build(cfg)
    remat = moe.TASK.build(moe.MoEConfig(**{**SMALL, "aux_loss_coef": 0.5, "remat": True}))
    model(batch["inputs"]), remat(batch["inputs"])
    remat.set_weights(model.get_weights())
    grads = []
    for m in (model, remat):
        with tf.GradientTape(persistent=True) as tape:
            loss, metrics = moe.TASK.loss_and_metrics(m, batch, True)
        assert float(loss) == pytest.approx(float(metrics["lm_loss"]) + 0.5 * float(metrics["aux_loss"]), rel=1e-6)
        assert 0.9 < float(metrics["aux_loss"]) < 2.0  # near 1 (balanced) at initialization
        assert float(metrics["loss_sum"]) / float(metrics["weight_sum"]) == pytest.approx(float(metrics["lm_loss"]))
        g_aux = tape.gradient(metrics["aux_loss"], m.blocks[1].moe_mlp.gate_kernel)
        assert np.abs(g_aux.numpy()).max() > 0
        grads.append(tape.gradient(loss, m.trainable_variables))
    for g, r in zip(*grads):
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(r).numpy(), atol=1e-6)


def report_rows(report: str) -> dict:
    """{variable name: its line} of a layout report."""
    return {line.split()[0]: line for line in report.splitlines() if line.strip() and not line.startswith("#")}


def train(model_dir, mesh, preset, steps=4):
    cfg = moe.MoEConfig(**SMALL)
    kw = dict(steps=steps, global_batch_size=16, steps_per_loop=steps, log_every=steps, checkpoint_every=100,
              synthetic_data=True, seed=1)
    opt = optimizers.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, decay_steps=8)
    controller = make_run(moe.TASK, cfg, TrainConfig(**kw), opt, mesh, model_dir, preset=preset)
    return controller.trainer, controller.train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 steps data parallel on data:8 and expert-parallel on data:2,expert:4."""
    base = tmp_path_factory.mktemp("moe")
    runs = {
        "data": train(base / "data", make_mesh("data:8"), "data"),
        "expert": train(base / "expert", make_mesh("data:2,expert:4"), "tensor"),
        "dir": base / "expert",
    }
    assert_golden_layouts(runs["data"][0].layout_report(), "moe_data_data8")
    assert_golden_layouts(runs["expert"][0].layout_report(), "moe_tensor_data2_expert4")
    return runs


def test_expert_parallel_loss_equals_data_parallel(runs):
    data, expert = runs["data"][1]["losses"], runs["expert"][1]["losses"]
    assert len(data) == len(expert) == 4 and len(set(expert)) == 4
    np.testing.assert_allclose(expert, data, rtol=1e-4)


def test_expert_weights_are_sharded(runs):
    trainer = runs["expert"][0]
    mlp = trainer.model.blocks[1].moe_mlp
    for w in (mlp.wi, mlp.wo):
        assert dtensor.fetch_layout(w).sharding_specs == ["expert", U, U]
        assert dtensor.unpack(w.read_value())[0].shape == (8 // 4, 64, 64)
        assert dtensor.fetch_layout(trainer.optimizer.get_slot(w, "m")).sharding_specs == ["expert", U, U]
    assert dtensor.fetch_layout(mlp.gate_kernel).sharding_specs == [U, U]
    report = report_rows(open(runs["dir"] / "layouts.txt").read())
    for name in ("moe/block_1/moe_mlp/wi", "moe/block_1/moe_mlp/wo"):
        assert "(8, 64, 64)" in report[name] and "[expert, unsharded, unsharded]" in report[name]
    data_kernel = runs["data"][0].model.blocks[1].moe_mlp.wi
    assert dtensor.fetch_layout(data_kernel).sharding_specs == [U, U, U]  # `data` preset: replicated


def test_dispatch_is_an_all_to_all_between_groups_and_experts(runs):
    """Eagerly on 8 devices: each stage's layout, and the layer's output equals a one-device copy's."""
    trainer = runs["expert"][0]
    mesh, mlp = trainer.placement.mesh, trainer.model.blocks[1].moe_mlp
    x = np.random.default_rng(2).normal(size=(16, 32, 64)).astype(np.float32)
    x_dt = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(x), dtensor.Layout.replicated(mesh, 3)),
                            dtensor.Layout(["data", U, U], mesh))
    layout = lambda t: dtensor.fetch_layout(t).sharding_specs
    with trainer.placement.activations():
        grouped = partitioning.shard(tf.reshape(x_dt, [16, 4, 8, 64]), moe.GROUPED_AXES)
        assert layout(grouped) == ["data", "expert", U, U]  # every device routes distinct tokens
        combine, dispatch, _ = mlp.route(grouped)
        assert layout(combine) == layout(dispatch) == ["data", "expert", U, U, U]
        expert_in = mlp.dispatch(grouped, dispatch)
        assert layout(expert_in) == ["expert", "data", U, U, U]  # [experts, batch, groups, capacity, embed]
        assert dtensor.unpack(expert_in)[0].shape == (2, 8, 4, 2, 64)  # 2 experts, 8 rows, all 4 groups
        expert_out = mlp.experts(expert_in)
        assert layout(expert_out) == ["expert", "data", U, U, U]
        assert layout(mlp.combine(expert_out, combine)) == ["data", "expert", U, U]
        y, aux = mlp(x_dt)

    def gather(v):  # a DVariable's full value on one device
        return dtensor.unpack(dtensor.relayout(v.read_value(), dtensor.Layout.replicated(mesh, v.shape.rank)))[0]

    plain = moe.MoEMLP(8, 64, 8, 2, name="plain")
    plain.build((None, 32, 64))
    plain.set_weights([gather(v).numpy() for v in (mlp.gate_kernel, mlp.wi, mlp.wo)])
    y_ref, aux_ref = plain(tf.constant(x))
    y_full = dtensor.unpack(dtensor.relayout(y, dtensor.Layout.replicated(mesh, 3)))[0]
    np.testing.assert_allclose(y_full.numpy(), y_ref.numpy(), rtol=1e-5, atol=1e-6)
    assert float(dtensor.unpack(aux)[0]) == pytest.approx(float(aux_ref), rel=1e-6)


def test_main_trains_moe_tiny_on_an_expert_mesh(tmp_path):
    params = ["train.steps=2", "train.steps_per_loop=2", "train.log_every=1", "moe.num_layers=2"]
    out = run(["gin/moe_tiny.gin"], params, str(tmp_path), mesh_spec="data:2,expert:4")
    assert len(out["losses"]) == 2 and all(math.isfinite(l) for l in out["losses"])
    records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2] and records[0]["mfu"] > 0
    report = open(tmp_path / "layouts.txt").read()
    assert "# moe variables on mesh data:2,expert:4" in report
    rows = report_rows(report)
    for name, shape in [("moe/block_1/moe_mlp/wi", "(8, 128, 256)"), ("moe/block_1/moe_mlp/wo", "(8, 256, 128)")]:
        assert shape in rows[name] and "[expert, unsharded, unsharded]" in rows[name]
    assert "moe.num_experts = 8" in open(tmp_path / "config.gin").read()


@pytest.mark.parametrize(
    "param,needle",
    [
        ("moe.group_size=12", "moe.group_size=12 does not divide moe.seq_len=64"),
        ("moe.num_experts=1", "moe.num_experts=1 must be at least 2"),
        ("moe.moe_every=1", "moe.moe_every=1 must be in [2, num_layers=4]"),
        ("moe.capacity_factor=0.0", "moe.capacity_factor=0.0 must be positive"),
        ("moe.aux_loss_coef=-1.0", "moe.aux_loss_coef=-1.0 must be >= 0"),
        ("moe.num_heads=7", "moe.embed_dim=128 is not divisible by moe.num_heads=7"),
    ],
)
@pytest.mark.unit
def test_config_errors_are_one_line(tmp_path, param, needle):
    with pytest.raises(UserError) as e:
        run(["gin/moe_tiny.gin"], [param], str(tmp_path), mesh_spec="data:2,expert:4")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
def test_groups_that_do_not_split_over_the_expert_axis_are_an_error(tmp_path):
    """64 / 32 = 2 groups per sequence cannot split over expert:4; DTensor would fail unreadably.

    The check runs while the step is traced, so autograph and Keras wrap the message in
    several lines of context (the trainer does not unwrap it yet): only its presence is asserted.
    """
    params = ["moe.group_size=32", "moe.num_layers=2", "train.steps=1", "train.synthetic_data=True"]
    with pytest.raises(UserError, match=r"2 routing groups per sequence \(length 64 / group_size 32\) do not divide "
                                        r"over mesh axis 'expert' of size 4"):
        run(["gin/moe_tiny.gin"], params, str(tmp_path), mesh_spec="data:2,expert:4")
