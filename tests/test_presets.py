"""Parallelism presets on 8 logical CPU devices: every preset trains the data-parallel losses.

Each sharded run starts from the same seed and global batch as the `data` run on
`data:8`, so its losses must equal that run's (relative 1e-4) step by step. The layout
report's per-device bytes show what each preset divides.
"""

import numpy as np
import pytest
from tensorflow.experimental import dtensor

from conftest import assert_golden_layouts, make_run
from tfpod import UserError, optimizers, partitioning
from tfpod.controller import Controller, TrainConfig
from tfpod.mesh import make_mesh
from tfpod.models import gpt

SMALL = dict(vocab_size=256, seq_len=32, num_layers=1, embed_dim=64, num_heads=8, mlp_dim=128)


def make(model_dir, spec, preset, steps=4, sequence_parallel=False, model=None, opt=None):
    cfg = gpt.GPTConfig(**{**SMALL, **(model or {})})
    train = TrainConfig(steps=steps, global_batch_size=16, steps_per_loop=2, log_every=2, checkpoint_every=2,
                        synthetic_data=True, seed=1)
    # clip_norm=0: gradients go to the optimizer as computed (the path where a DTensor
    # pass once reordered the weight-update gather).
    opt_cfg = optimizers.OptimizerConfig(**{"learning_rate": 1e-2, "warmup_steps": 0, "decay_steps": 8,
                                            "clip_norm": 0, **(opt or {})})
    return make_run(gpt.TASK, cfg, train, opt_cfg, spec, model_dir, preset=preset, sequence_parallel=sequence_parallel)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The data-parallel run: its trainer and its 4 losses."""
    trainer = make(tmp_path_factory.mktemp("data"), "data:8", "data")
    assert_golden_layouts(trainer.trainer.layout_report(), "gpt_data_data8")
    return trainer, np.array(trainer.train()["losses"])


def assert_same_losses(losses, reference_losses):
    losses = np.asarray(losses)
    assert losses.shape == reference_losses.shape
    rel = np.abs(losses - reference_losses) / np.abs(reference_losses)
    assert rel.max() < 1e-4, (losses, reference_losses)


def device_bytes(run, names, state=False):
    t = run.trainer
    specs, layouts = (t.state_specs, t.state_layouts) if state else (t.specs, t.layouts)
    return sum(partitioning.bytes_per_device(s.shape, s.dtype, layouts[s.name]) for s in specs if names(s.name))


def test_tensor_splits_heads_mlp_and_vocab_over_model(tmp_path, reference):
    ref, ref_losses = reference
    trainer = make(tmp_path, "data:2,model:4", "tensor")
    assert_golden_layouts(trainer.trainer.layout_report(), "gpt_tensor_data2_model4")
    assert_same_losses(trainer.train()["losses"], ref_losses)
    mlp = lambda n: "/intermediate/" in n or "/output/kernel" in n
    assert device_bytes(trainer, mlp) * 4 == device_bytes(ref, mlp)
    attention = lambda n: "/self_attention/" in n and "attention_output/bias" not in n
    assert device_bytes(trainer, attention) * 4 == device_bytes(ref, attention)
    embedding = lambda n: "token_embedding" in n
    assert device_bytes(trainer, embedding) * 4 == device_bytes(ref, embedding)  # vocab-parallel
    out = trainer.trainer.model.blocks[0].output_dense.kernel  # row-parallel out of the block
    assert dtensor.fetch_layout(out).sharding_specs == ["model", dtensor.UNSHARDED]


def test_2d_also_splits_weights_over_data_and_gathers_them_where_used(tmp_path, reference):
    ref, ref_losses = reference
    trainer = make(tmp_path, "data:4,model:2", "2d")
    assert_golden_layouts(trainer.trainer.layout_report(), "gpt_2d_data4_model2")
    assert_same_losses(trainer.train()["losses"], ref_losses)
    kernel = trainer.trainer.model.blocks[0].intermediate.kernel
    assert dtensor.fetch_layout(kernel).sharding_specs == ["data", "model"]
    assert dtensor.unpack(kernel.read_value())[0].shape == (64 // 4, 128 // 2)
    every = lambda n: True
    # Every weight with an `embed` dimension is divided over data:4, and heads/mlp/vocab over model:2.
    assert device_bytes(trainer, every) < device_bytes(ref, every) / 4
    assert device_bytes(trainer, every, state=True) < device_bytes(ref, every, state=True) / 4
    assert "gpt/block_0/intermediate/kernel" in trainer.trainer.gathered


def test_weight_update_shards_optimizer_state_over_data_and_checkpoints_portably(tmp_path, reference):
    """data:8: weights replicated, Adam slots and the update divided by 8; the checkpoint resumes under `data`."""
    ref, ref_losses = reference
    trainer = make(tmp_path, "data:8", "weight_update", steps=2)
    assert_golden_layouts(trainer.trainer.layout_report(), "gpt_weight_update_data8")
    assert_same_losses(trainer.train()["losses"], ref_losses[:2])
    slots = lambda n: n.endswith("/m") or n.endswith("/v")
    assert device_bytes(trainer, slots, state=True) * 8 == device_bytes(ref, slots, state=True)
    every = lambda n: True
    assert device_bytes(trainer, every) == device_bytes(ref, every)  # weights replicated for compute
    copies = lambda n: n.endswith("/update_shard")
    assert device_bytes(trainer, copies, state=True) * 8 == device_bytes(ref, every)
    kernel = trainer.trainer.model.blocks[0].intermediate.kernel
    assert dtensor.fetch_layout(trainer.trainer.optimizer.get_slot(kernel, "m")).sharding_specs == ["data", dtensor.UNSHARDED]
    report = open(tmp_path / "layouts.txt").read()
    assert "# adamw optimizer state, update sharded over 'data' on mesh data:8" in report
    assert "gpt/block_0/intermediate/kernel/m" in report and "gpt/block_0/intermediate/kernel/update_shard" in report
    # The slots are saved under their weights: the same checkpoint resumes with the data preset (in
    # the reference's model and compiled steps, at step 4: the restore must set every weight, slot and the step).
    assert int(ref.trainer.step.numpy()) == 4
    resumed = Controller(ref.trainer, ref.cfg, str(tmp_path))
    assert resumed.restore() == 2
    assert_same_losses(resumed.train()["losses"], ref_losses[2:])


def test_sequence_parallel_and_recomputation(tmp_path, reference):
    """Megatron sequence parallelism over model:2 with per-block recomputation: same losses."""
    _, ref_losses = reference
    trainer = make(tmp_path, "data:4,model:2", "tensor", sequence_parallel=True, model={"remat": True})
    assert trainer.trainer.placement.table["sequence"] == "model"
    assert_same_losses(trainer.train()["losses"], ref_losses)


@pytest.mark.unit
def test_sequence_axis_shards_the_residual_stream(tmp_path):
    import tensorflow as tf

    mesh = make_mesh("data:4,model:2")
    config = partitioning.ShardingConfig(preset="tensor", sequence_parallel=True)
    table = config.table(config.preset_for("data"))
    x = dtensor.copy_to_mesh(tf.ones([8, 32, 16]), dtensor.Layout.replicated(mesh, 3))
    with partitioning.activation_sharding(mesh, table):
        y = partitioning.shard(x, gpt.ACTIVATION_AXES)
    assert dtensor.fetch_layout(y).sharding_specs == ["data", "model", dtensor.UNSHARDED]


@pytest.mark.unit
def test_update_layout_picks_the_first_free_divisible_dimension():
    mesh = make_mesh("data:4,model:2")
    U = dtensor.UNSHARDED
    layout = lambda *specs: dtensor.Layout(list(specs), mesh)
    assert partitioning.update_layout(layout(U, "model"), (64, 128), "data").sharding_specs == ["data", "model"]
    assert partitioning.update_layout(layout(U, U), (6, 8), "data").sharding_specs == [U, "data"]  # 6 % 4
    assert partitioning.update_layout(layout(U,), (6,), "data").sharding_specs == [U]  # nothing divides: as the weight
    assert partitioning.update_layout(layout("data", U), (8, 8), "data").sharding_specs == ["data", U]
    assert partitioning.update_layout(layout(U, U), (8, 8), None).sharding_specs == [U, U]
    assert partitioning.update_layout(layout(U, U), (8, 8), "expert").sharding_specs == [U, U]  # no such axis


@pytest.mark.unit
def test_presets_are_tables_and_switches():
    assert set(partitioning.PRESETS) == {"data", "tensor", "2d", "weight_update", "spatial"}
    assert partitioning.rules_table("spatial")["height"] == "model" and partitioning.rules_table("spatial")["mlp"] is None
    assert partitioning.rules_table("2d")["embed"] == "data" and partitioning.rules_table("2d")["mlp"] == "model"
    mesh = make_mesh("data:4,model:2")
    placement = lambda **kw: partitioning.Placement.from_config(partitioning.ShardingConfig(**kw), "tensor", mesh)
    wu = placement(preset="weight_update")
    assert wu.update_axis == "data" and wu.gather_axis is None
    assert placement(preset="weight_update", update_axis="").update_axis is None
    assert placement(preset="2d").gather_axis == "data"
    config = partitioning.ShardingConfig(preset="data", rules={"mlp": "model"})
    assert config.preset_for("tensor").name == "data" and config.table(config.preset_for("tensor"))["mlp"] == "model"


@pytest.mark.unit
def test_a_preset_is_one_object_and_one_registration(monkeypatch):
    """A Preset answers its table, axes, search and checks; registering one makes
    sharding.preset='<name>' pick it, with no other file touched."""
    from tfpod.partitioning import presets

    assert [p.name for p in presets.PRESETS.values() if p.searched] == ["data", "tensor", "2d", "weight_update"]
    tensor, wu, spatial = (presets.get_preset(n) for n in ("tensor", "weight_update", "spatial"))
    assert not tensor.tried_on({"data"}) and tensor.tried_on({"data", "expert"}) and wu.tried_on({"data"})
    assert not spatial.tried_on({"data", "model"}) and presets.get_preset("data").tried_on({"data", "model"})
    monkeypatch.setattr(presets, "PRESETS", dict(presets.PRESETS))  # registered for this test only
    mine = presets.register(presets.Preset("mlp_only", {"batch": "data", "mlp": "model"}, "mlp over model",
                                           update_axis="model"))
    placement = partitioning.Placement.from_config(partitioning.ShardingConfig(preset="mlp_only"), "data",
                                                   make_mesh("data:4,model:2"))
    assert placement.preset is mine and placement.table["mlp"] == "model" and placement.table["heads"] is None
    assert placement.update_axis == "model" and placement.gather_axis is None
    with pytest.raises(UserError, match="a preset named 'mlp_only' exists"):
        presets.register(mine)
    presets.register(presets.Preset("typo", {"mlpp": "model"}, ""))
    with pytest.raises(UserError, match="sharding.preset='typo': its table names unknown logical axis 'mlpp'"):
        partitioning.rules_table("typo")
    with pytest.raises(UserError, match="sharding.preset='nope' is not a preset: use one of 2d, data, mlp_only"):
        partitioning.get_preset("nope")
    # A placement built by hand has a Preset of its own table, checked as a named one is.
    from tfpod.models import gpt

    by_hand = partitioning.Placement(make_mesh("data:4,model:2"), {"batch": "data", "height": "model"})
    assert by_hand.preset.name == "custom" and by_hand.preset.table == {"batch": "data", "height": "model"}
    with pytest.raises(UserError, match="image rows .* but model 'gpt' has no image rows to split"):
        by_hand.preset.check_run(gpt.TASK, by_hand)


def test_recomputation_with_dropout_replays_the_forward_passs_masks(tmp_path):
    """gpt.remat=True with dropout: the recomputed block draws the masks its forward pass drew
    (tfpod's dropout is stateless, seeded by layer, step and microbatch), so the losses and the
    weights after 4 steps equal those without recomputation; on 2 devices (the `data` halves
    of a batch draw different masks). Outside tfpod's Trainer the dropout layers draw from
    Keras's stateful generator, and the recomputed block is refused with one line."""
    import tensorflow as tf

    from conftest import device_mesh
    from tfpod import UserError

    dropout = {"dropout": 0.1, "attention_dropout": 0.1}
    runs = {remat: make(tmp_path / str(remat), device_mesh("data:2"), "data", model={**dropout, "remat": remat})
            for remat in (False, True)}
    losses = {remat: np.array(run.train()["losses"]) for remat, run in runs.items()}
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    plain = make(tmp_path / "plain", device_mesh(), "data").train()["losses"]  # no dropout (1 device: the same math)
    assert np.abs(np.array(plain) - losses[False]).max() > 1e-3  # the dropout is on
    weights = {remat: {v.name: dtensor.unpack(v.read_value())[0].numpy() for v in run.trainer.model.trainable_variables}
               for remat, run in runs.items()}  # (`data` replicates every weight)
    for name, value in weights[False].items():
        np.testing.assert_allclose(weights[True][name], value, rtol=1e-5, atol=1e-6, err_msg=name)

    model = gpt.TASK.build(gpt.GPTConfig(**SMALL, **dropout, remat=True))
    with pytest.raises(UserError, match="gpt.remat=True with dropout: dropout layer .* stateful generator"):
        model({"inputs": tf.zeros([2, 32], tf.int32)}, training=True)
