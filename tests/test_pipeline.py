"""Pipeline stages on 8 logical CPU devices: the same losses as data parallelism, every schedule.

Each pipelined run starts from the same seed and global batch as the `data:8` run, so its
losses must equal that run's (relative 1e-4) step by step: here M microbatches in 1, 2, 4,
8 on `stage:2,data:4` (MoE), `stage:2,data:2,model:2` and `stage:4,data:2`, both
schedules, sequence parallelism and recomputation inside the stages (`bench/pipeline.py
--parts=equality` runs every mesh x M x schedule).
Checkpoints move between pipelined and unpipelined meshes both ways. (2 hosts, each holding
part of every stage: tests/test_multihost.py, killed with -9 mid-run and resumed exactly, and
resumed from an unpipelined checkpoint with one unpipelined process's losses.)
"""

import shutil

import numpy as np
import pytest

from conftest import device_mesh, make_run
from tfpod import UserError, optimizers
from tfpod.api import run
from tfpod.controller import Controller, TrainConfig
from tfpod.models import bert, gpt, moe
from tfpod.partitioning import ShardingConfig, check_microbatches, split_microbatches, stages
from tfpod.pipeline import schedules

SMALL = dict(vocab_size=256, seq_len=32, num_layers=4, embed_dim=64, num_heads=8, mlp_dim=128)


def make(model_dir, spec, microbatches=1, schedule="gpipe", steps=4, preset="tensor", task=gpt.TASK, config=None,
         batch=16, checkpoint_every=2, **sharding):
    train = TrainConfig(steps=steps, global_batch_size=batch, steps_per_loop=2, log_every=2,
                        checkpoint_every=checkpoint_every, synthetic_data=True, seed=1, microbatches=microbatches)
    opt = optimizers.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, decay_steps=8)
    return make_run(task, config or gpt.GPTConfig(**SMALL), train, opt, spec, model_dir, preset=preset,
                    pipeline_schedule=schedule, **sharding)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The data-parallel run (checkpoints at steps 2 and 4) and its losses."""
    d = tmp_path_factory.mktemp("data")
    run = make(d, "data:8")
    return d, run, np.array(run.train()["losses"])


def assert_same_losses(losses, reference_losses):
    np.testing.assert_allclose(np.asarray(losses), reference_losses, rtol=1e-4)


# -- the same math --------------------------------------------------------------------------

@pytest.mark.parametrize("spec,microbatches,schedule,options", [
    ("stage:2,data:2,model:2", 2, "1f1b", {"sequence_parallel": True, "remat": True}),
    ("stage:4,data:2", 4, "gpipe", {}),
], ids=["stage2-data2-model2-M2-1f1b-sp-remat", "stage4-data2-M4-gpipe"])
def test_pipelines_train_the_data_parallel_losses(tmp_path, reference, spec, microbatches, schedule, options):
    options = dict(options)
    config = gpt.GPTConfig(**SMALL, remat=options.pop("remat", False))
    run = make(tmp_path, spec, microbatches, schedule, config=config, checkpoint_every=4, **options)  # (at the end)
    assert_same_losses(run.train()["losses"], reference[2])
    report = run.trainer.layout_report()
    num_stages = int(spec.split(",")[0].split(":")[1])
    assert f"on mesh {spec}" in report and "# stage 1:" in report
    rows = [line.split() for line in report.splitlines() if line.startswith("gpt/block_")]
    held = {row[0]: int(row[-1]) for row in rows}  # the block's stage (the last column)
    assert held["gpt/block_0/output/kernel"] == 0 and held["gpt/block_3/output/kernel"] == num_stages - 1


def test_checkpoints_move_between_pipelined_and_unpipelined_meshes(tmp_path, reference):
    ref_dir, ref_run, ref_losses = reference
    # data:8's step-2 checkpoint goes on in a pipeline ...
    shutil.copytree(ref_dir / "checkpoints", tmp_path / "a" / "checkpoints")
    for f in (tmp_path / "a" / "checkpoints").glob("ckpt-4*"):
        f.unlink()
    a = make(tmp_path / "a", "stage:2,data:2,model:2", 1, "1f1b")  # M=1: one microbatch, no overlap
    assert a.restore() == 2
    assert_same_losses(a.train()["losses"], ref_losses[2:])
    # ... and the pipeline's step-2 checkpoint goes on in data:8 (the reference's model and compiled
    # steps, at step 4, in a run of its own: the restore must set every weight, slot and the step).
    for f in (tmp_path / "a" / "checkpoints").glob("ckpt-4*"):
        f.unlink()
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    assert int(ref_run.trainer.step.numpy()) == 4
    b = Controller(ref_run.trainer, ref_run.cfg, str(tmp_path / "b"))
    assert b.restore() == 2
    assert_same_losses(b.train()["losses"], ref_losses[2:])

    # Evaluation runs through the stages: the same metrics as the unpipelined model's (both at step 4).
    rng = np.random.default_rng(3)
    batches = [gpt.TASK.synthetic_batch(a.trainer.model_config, 16, rng) for _ in range(2)]
    piped, plain = a.trainer.evaluate(batches, 16), b.trainer.evaluate(batches, 16)
    assert piped["num_examples"] == plain["num_examples"] == 32
    np.testing.assert_allclose(piped["loss"], plain["loss"], rtol=1e-5)


def test_stages_the_blocks_do_not_divide_evenly_train_one_devices_losses(tmp_path):
    """3 blocks on 2 stages (2 + 1): one device's losses; the report puts each block on its stage."""
    config = gpt.GPTConfig(**{**SMALL, "num_layers": 3})
    plain = make(tmp_path / "plain", device_mesh(), config=config, steps=2)
    piped = make(tmp_path / "piped", "stage:2,data:2,model:2", 2, "1f1b", config=config, steps=2)
    assert_same_losses(piped.train()["losses"], np.array(plain.train()["losses"]))
    rows = [line.split() for line in piped.trainer.layout_report().splitlines() if line.startswith("gpt/block_")]
    held = {row[0].split("/")[1]: int(row[-1]) for row in rows}
    assert held == {"block_0": 0, "block_1": 0, "block_2": 1}
    assert stages.stage_sizes(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B as Meta staged it
    assert stages.stage_sizes(5, 4) == [1, 2, 1, 1] and stages.stage_sizes(8, 4) == [2] * 4


def test_moe_pipelines_with_its_aux_loss(tmp_path):
    config = moe.MoEConfig(vocab_size=256, seq_len=32, num_layers=2, embed_dim=64, num_heads=8, mlp_dim=128,
                           num_experts=4, expert_mlp_dim=64, moe_every=2, group_size=16)  # stage 1's block is the MoE
    plain = make(tmp_path / "plain", device_mesh(), task=moe.TASK, config=config, preset="data", steps=2)  # 1 device
    piped = make(tmp_path / "piped", "stage:2,data:4", 2, "1f1b", task=moe.TASK, config=config, preset="data", steps=2)
    assert_same_losses(piped.train()["losses"], np.array(plain.train()["losses"]))


def test_bert_pipelines_with_both_pretraining_losses(tmp_path):
    """BERT's loss is two means over different counts (real predictions, examples): each
    term is summed over the microbatches and divided by its own count."""
    config = bert.BertConfig(vocab_size=128, seq_len=32, max_predictions=5, num_layers=2, hidden_size=64,
                             num_heads=4, intermediate_size=128, dropout=0.0, attention_dropout=0.0,
                             next_sentence=True)
    plain = make(tmp_path / "plain", device_mesh(), task=bert.TASK, config=config, steps=2)  # on 1 device
    piped = make(tmp_path / "piped", "stage:2,data:2,model:2", 2, "1f1b", task=bert.TASK, config=config, steps=2)
    assert_same_losses(piped.train()["losses"], np.array(plain.train()["losses"]))
    assert "bert/encoder/transformer/layer_1/output/kernel" in piped.trainer.layout_report()
    rng = np.random.default_rng(3)
    batches = [bert.TASK.synthetic_batch(config, 16, rng)]
    np.testing.assert_allclose(piped.trainer.evaluate(batches, 16)["masked_lm_accuracy"],
                               plain.trainer.evaluate(batches, 16)["masked_lm_accuracy"])


def test_fewer_blocks_than_stages_and_a_task_that_does_not_pipeline(tmp_path):
    with pytest.raises(UserError, match=r"sharding.preset='2d' inside pipeline stages .* is not supported"):
        make(tmp_path / "c", "stage:2,data:4", preset="2d")
    with pytest.raises(UserError, match=r"an update sharded over 'data' inside pipeline stages"):
        make(tmp_path / "d", "stage:2,data:4", preset="weight_update")
    with pytest.raises(UserError, match=r"--mesh: 3 blocks cannot fill 4 stages: use at most 3 stages"):
        make(tmp_path / "a", "stage:4,data:2", config=gpt.GPTConfig(**{**SMALL, "num_layers": 3}))
    from tfpod.models import resnet

    with pytest.raises(UserError, match=r"model 'resnet' does not run in pipeline stages.*gpt"):
        make_run(resnet.TASK, resnet.ResNetConfig(depth=18, depth_multiplier=0.25, num_classes=10, image_size=32),
                 TrainConfig(global_batch_size=16, synthetic_data=True, microbatches=2),
                 optimizers.OptimizerConfig(name="sgd", weight_decay=0), "stage:2,data:4", tmp_path / "b")


# -- schedules and microbatches, without devices ------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("num_stages,microbatches", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 2), (4, 8)])
def test_schedules_run_every_action_once_with_their_memory_and_bubble(num_stages, microbatches):
    for name in schedules.SCHEDULES:
        plan = schedules.schedule(name, num_stages, microbatches)
        events = schedules.timeline(plan)  # a deadlock raises
        for s in range(num_stages):
            ran = sorted(a for _, stage, a in events if stage == s)
            assert ran == sorted([("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)])
        alive = [schedules.in_flight(actions) for actions in plan]
        expected = [microbatches] * num_stages if name == "gpipe" else [min(num_stages - s, microbatches)
                                                                        for s in range(num_stages)]
        assert alive == expected
        assert schedules.measured_bubble(plan) == pytest.approx(schedules.bubble_fraction(num_stages, microbatches))


@pytest.mark.unit
def test_microbatches_take_rows_of_every_batch_shard():
    rows = np.arange(16)[:, None] * np.ones((1, 3), int)  # host rows 0..15, two shards of 8
    split = split_microbatches({"x": rows}, 4, local_shards=2)["x"]
    assert split.shape == (4, 4, 3)
    assert split[1, :, 0].tolist() == [2, 3, 10, 11]  # the 2nd quarter of each shard
    with pytest.raises(UserError, match=r"train.microbatches=3 does not divide the 8 examples each batch shard"):
        check_microbatches(16, 2, 3)


@pytest.mark.unit
def test_stage_settings_are_checked():
    with pytest.raises(UserError, match="sharding.pipeline_schedule='zigzag'"):
        ShardingConfig(pipeline_schedule="zigzag")
    with pytest.raises(UserError, match="train.microbatches=0 must be at least 1"):
        TrainConfig(microbatches=0)
    with pytest.raises(UserError, match="3 stages over 4 devices per host"):
        stages.stage_meshes([("data", 2)], 3, "CPU", 2, 0, 4)
    assert stages.split_stage_axis([("stage", 2), ("data", 4)]) == (2, [("data", 4)])


@pytest.mark.unit
def test_every_stage_takes_a_share_of_every_host():
    """Host 1 of 2 (4 devices): stage s holds its devices 2s and 2s+1, data shard 1 of each stage."""
    meshes = stages.stage_meshes([("data", 2), ("model", 2)], 2, "CPU", 2, 1, 4)
    assert [m.local_devices() for m in meshes] == [
        [f"/job:worker/replica:0/task:1/device:CPU:{i}" for i in (0, 1)],
        [f"/job:worker/replica:0/task:1/device:CPU:{i}" for i in (2, 3)]]
    assert [loc["data"] for loc in meshes[1].local_device_locations()] == [1, 1]
    # One host: the local job's names, unless a launcher made it a job of one (its DTENSOR_JOB_NAME).
    alone, launched = (stages.stage_meshes([("data", 2)], 2, "CPU", 1, 0, 4, job) for job in (None, "worker"))
    assert alone[1].local_devices()[0] == "/job:localhost/replica:0/task:0/device:CPU:2"
    assert launched[1].local_devices()[0] == "/job:worker/replica:0/task:0/device:CPU:2"
