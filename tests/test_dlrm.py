"""DLRM-DCNv2 (models/dlrm.py) with sharded embedding tables: sharded training equal to one
device's, exact resume, checkpoints moving between meshes, the tiny recipe reaching its
teacher's AUC, the reference's Criteo multi-hot files read per host with their position
checkpointed, two hosts evaluating every example once, and the served model."""

import collections
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from conftest import ROOT, assert_golden_layouts, device_mesh, launch_command
from tfpod import UserError
from tfpod.api import run
from tfpod.input import clicks, criteo
from tfpod.input.common import ShardInfo
from tfpod.models import dlrm

SMALL = ["train.global_batch_size=64", "train.steps_per_loop=2", "train.log_every=1", "train.checkpoint_every=2",
         "train.eval_every=4", "click_data.eval_examples=512"]


def records(model_dir, kind):
    return [r for r in (json.loads(l) for l in open(os.path.join(model_dir, "metrics.jsonl"))) if r["kind"] == kind]


def losses(model_dir) -> dict:
    return {r["step"]: r["loss"] for r in records(model_dir, "train")}


def test_sharded_tables_train_as_one_device_resume_exactly_and_move_between_meshes(tmp_path):
    """dlrm_tiny on data:4,model:2 (tables' rows split over `model`, each device updating its
    own rows) has one device's losses; stopped at step 2 and resumed, the same losses and eval
    bit for bit; its checkpoint evaluates on data:2,model:4 (other row shards) to the same
    AUC and loss."""
    sharded, one, resumed = (str(tmp_path / n) for n in ("sharded", "one", "resumed"))
    params = SMALL + ["train.steps=4"]
    run(["gin/dlrm_tiny.gin"], params, sharded, mode="train_and_eval", mesh_spec="data:4,model:2")
    run(["gin/dlrm_tiny.gin"], params, one, mode="train_and_eval", mesh=device_mesh("data:1"))
    a, b = losses(sharded), losses(one)
    assert sorted(a) == [1, 2, 3, 4] and a[4] < a[1]
    np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], rtol=2e-5)
    run(["gin/dlrm_tiny.gin"], SMALL + ["train.steps=2"], resumed, mode="train_and_eval", mesh_spec="data:4,model:2")
    run(["gin/dlrm_tiny.gin"], params, resumed, mode="train_and_eval", mesh_spec="data:4,model:2")
    assert losses(resumed) == a
    final = records(sharded, "eval")[-1]
    assert records(resumed, "eval")[-1]["auc"] == final["auc"] and final["num_examples"] == 512
    assert abs(records(one, "eval")[-1]["auc"] - final["auc"]) < 1e-5
    moved = run(["gin/dlrm_tiny.gin"], SMALL, sharded, mode="eval", mesh_spec="data:2,model:4")
    assert moved["auc"] == pytest.approx(final["auc"], abs=1e-6)
    assert moved["loss"] == pytest.approx(final["loss"], rel=1e-5)
    assert_golden_layouts(open(os.path.join(sharded, "layouts.txt")).read(), "dlrm_tensor_data4_model2")
    # under `2d` (columns over `data`, weights gathered where read) the tables are never gathered: the same losses
    two_d = str(tmp_path / "2d")
    run(["gin/dlrm_tiny.gin"], SMALL + ["train.steps=2", "sharding.preset='2d'"], two_d, mode="train",
        mesh_spec="data:4,model:2")
    np.testing.assert_allclose([losses(two_d)[s] for s in (1, 2)], [a[s] for s in (1, 2)], rtol=2e-5)


def test_tables_placed_whole_train_as_one_device_and_checkpoints_move_both_ways(tmp_path):
    """sharding.tables='whole' (table-wise): on data:8 with the tables' rows over `data` each
    table lies whole on one device, balanced by bytes, and trains with one device's losses;
    its checkpoint goes on under row-split tables on data:4,model:2, and a one-device
    checkpoint goes on with the tables whole over `model` there, both with the same losses."""
    one, placed, back = (str(tmp_path / n) for n in ("one", "placed", "back"))
    whole = ["sharding.tables='whole'"]
    run(["gin/dlrm_tiny.gin"], SMALL + ["train.steps=2"], one, mode="train", mesh=device_mesh("data:1"))
    shutil.copytree(one, back)
    run(["gin/dlrm_tiny.gin"], SMALL + ["train.steps=4"], one, mode="train", mesh=device_mesh("data:1"))
    run(["gin/dlrm_tiny.gin"], SMALL + ["train.steps=2", "sharding.rules={'vocab': 'data'}"] + whole, placed,
        mode="train", mesh_spec="data:8")
    report = open(os.path.join(placed, "layouts.txt")).read()
    homes = re.findall(r"dlrm/table_\d+/embeddings .*\[unsharded, unsharded\] on data=(\d)", report)
    assert sorted(homes) == [str(p) for p in range(8)], report  # 8 tables, one per device
    assert "(the most any device holds)" in report
    run(["gin/dlrm_tiny.gin"], SMALL + ["train.steps=4"], placed, mode="train", mesh_spec="data:4,model:2")
    run(["gin/dlrm_tiny.gin"], SMALL + ["train.steps=4"] + whole, back, mode="train", mesh_spec="data:4,model:2")
    reference = losses(one)
    for model_dir in (placed, back):
        got = losses(model_dir)
        np.testing.assert_allclose([got[s] for s in (1, 2, 3, 4)], [reference[s] for s in (1, 2, 3, 4)], rtol=2e-5)


def test_tiny_recipe_reaches_its_teachers_auc(tmp_path):
    """gin/dlrm_tiny.gin on one device stops once its exact AUC is within 0.01 of the teacher's."""
    model_dir = str(tmp_path / "tiny")
    run(["gin/dlrm_tiny.gin"], [], model_dir, mode="train_and_eval", mesh=device_mesh("data:1"))
    final = records(model_dir, "eval")[-1]
    assert final["teacher_auc"] == pytest.approx(0.8679, abs=1e-4)
    assert final["auc"] >= final["teacher_auc"] - 0.01, final


def test_one_device_steps_called_past_dtensor_equal_dtensors_calls(tmp_path, monkeypatch):
    """On a mesh of one device the tables' loop calls the step's program as DTensor expanded it,
    directly (compat.dtensor_local_program), from a loop call's third step on: the same losses,
    eval and weights as every step called through DTensor."""
    from tfpod import compat
    from tfpod.embedding import executor

    found = []
    program = compat.dtensor_local_program
    monkeypatch.setattr(compat, "dtensor_local_program", lambda *a: found.append(program(*a)) or found[-1])
    params = SMALL + ["train.steps=8", "train.steps_per_loop=8", "train.log_every=8", "train.eval_every=8"]
    direct, through = str(tmp_path / "direct"), str(tmp_path / "through")
    run(["gin/dlrm_tiny.gin"], params, direct, mode="train_and_eval", mesh=device_mesh("data:1"))
    assert found and found[-1] is not None and len(found) <= executor._CompiledStep.TRIES
    monkeypatch.setattr(executor._CompiledStep, "TRIES", 0)
    run(["gin/dlrm_tiny.gin"], params, through, mode="train_and_eval", mesh=device_mesh("data:1"))
    assert losses(direct) == losses(through) and list(losses(direct)) == [8]
    assert records(direct, "eval")[-1]["auc"] == records(through, "eval")[-1]["auc"]
    a, b = (tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(d, "checkpoints")))
            for d in (direct, through))
    for name in a.get_variable_to_shape_map():
        np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name), err_msg=name)


TINY = dlrm.DLRMConfig(table_sizes=(40, 12, 9), multi_hot_sizes=(3, 1, 2), embedding_dim=4, bottom_mlp=(8, 4),
                       top_mlp=(8, 1), cross_layers=1, cross_rank=4, row_multiple=4)


def write_days(folder, rows=(50, 30, 40), config=TINY):
    """Criteo-format days 0..n-1 of synthetic clicks (the teacher's), as the reference writes them."""
    paths, data = [], []
    for day, n in enumerate(rows):
        batch = {k: v.numpy() for k, v in clicks.generate(clicks.ClickDataConfig(), config, 7, day, n).items()}
        sparse = [batch[f"cat_{t}"] for t in range(len(config.table_sizes))]
        paths.append(criteo.write_day(str(folder), day, batch["dense"], batch["labels"], sparse))
        data.append(batch)
    return paths, data


@pytest.mark.unit
def test_criteo_files_read_per_host_once_with_a_checkpointed_position(tmp_path):
    paths, data = write_days(tmp_path)
    cfg = clicks.ClickDataConfig(format="criteo", train_files=f"{tmp_path}/day_[01]_dense.npy",
                                 eval_files=paths[2], shuffle_buffer=0)
    seen = []
    for host in range(2):
        task_input = criteo.criteo_input(cfg, TINY, ShardInfo(host, 2), seed=0)
        it = iter(task_input.train(8))
        first = next(it)
        assert first["dense"].shape == (8, 13) and first["cat_0"].shape == (8, 3) and first["labels"].dtype == tf.float32
        checkpoint = tf.train.Checkpoint(iterator=it)
        path = checkpoint.save(str(tmp_path / f"position{host}"))
        expected = next(it)
        restored = iter(task_input.train(8))
        tf.train.Checkpoint(iterator=restored).restore(path)
        np.testing.assert_array_equal(next(restored)["cat_0"].numpy(), expected["cat_0"].numpy())
        seen.append(np.concatenate([b["dense"].numpy() for b in task_input.eval(16)]))
    half = 20  # day 2's first half (the reference's validation rows)
    np.testing.assert_array_equal(np.concatenate(seen), data[2]["dense"][:half])
    host0 = criteo.host_ranges([criteo.open_day(p, 3) for p in paths[:2]], [(0, 50), (0, 30)], ShardInfo(0, 2))
    assert [(os.path.basename(d.dense.path), a, b) for d, a, b in host0] == [("day_0_dense.npy", 0, 40)]
    np.testing.assert_array_equal(
        next(iter(criteo.criteo_input(cfg, TINY, ShardInfo(0, 1), 0).train(50)))["cat_2"].numpy(),
        data[0]["cat_2"] % 9)
    with pytest.raises(UserError, match="multi_hot_sizes"):
        wrong = dlrm.DLRMConfig(**{**TINY.__dict__, "multi_hot_sizes": (3, 1, 1)})
        criteo.criteo_input(cfg, wrong, ShardInfo(0, 1), 0)


def test_two_hosts_evaluate_every_example_once_and_the_served_model_agrees(tmp_path):
    """Trained on Criteo-format files on one host (data:2,model:2), the checkpoint evaluates on 2
    hosts x 2 devices to the same exact AUC over the same examples; the exported SavedModel,
    fed the raw features, gives probabilities whose sklearn AUC is the run's; the 2 hosts then
    train on with the tables placed whole (sharding.tables='whole'), with the losses they have
    with the tables' rows split."""
    from sklearn.metrics import roc_auc_score

    paths, data = write_days(tmp_path / "data", rows=(256, 256, 200))
    model_dir = str(tmp_path / "run")
    params = ["dlrm.table_sizes=(40, 12, 9)", "dlrm.multi_hot_sizes=(3, 1, 2)", "dlrm.embedding_dim=4",
              "dlrm.bottom_mlp=(8, 4)", "dlrm.top_mlp=(8, 1)", "dlrm.cross_layers=1", "dlrm.cross_rank=4",
              "dlrm.row_multiple=4", "click_data.format='criteo'", "click_data.shuffle_buffer=0",
              f"click_data.train_files='{tmp_path}/data/day_[01]_dense.npy'", f"click_data.eval_files='{paths[2]}'",
              "train.steps=4", "train.eval_every=4"] + [p for p in SMALL if "eval_every" not in p]
    run(["gin/dlrm_tiny.gin"], params, model_dir, mode="train_and_eval", mesh=device_mesh("data:2,model:2"))
    single = records(model_dir, "eval")[-1]
    assert single["num_examples"] == 100  # the first half of day 2
    command = launch_command(2, 2, "--gin_file=gin/dlrm_tiny.gin", "--mesh=data:2,model:2", f"--model_dir={model_dir}",
                             "--mode=eval", *[f"--gin_param={p}" for p in params])
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(records(model_dir, "eval")) == 2  # the 2 hosts' evaluation, written by host 0
    two = records(model_dir, "eval")[-1]
    assert two["num_examples"] == 100 and two["auc"] == pytest.approx(single["auc"], abs=1e-9)
    run(["gin/dlrm_tiny.gin"], params, model_dir, mode="export")
    exported = [os.path.join(d, v) for d, _, fs in os.walk(os.path.join(model_dir, "export")) for v in fs
                if v == "saved_model.pb"]
    served = tf.saved_model.load(os.path.dirname(exported[0])).signatures["serving_default"]
    rows = slice(0, 100)
    features = {"dense": tf.constant(data[2]["dense"][rows])}
    features.update({f"cat_{t}": tf.constant(data[2][f"cat_{t}"][rows]) for t in range(3)})
    probabilities = served(**features)["probabilities"].numpy()
    assert roc_auc_score(data[2]["labels"][rows], probabilities) == pytest.approx(single["auc"], abs=1e-6)
    # and 2 more steps trained on the 2 hosts with the tables placed whole over `model` (each host
    # reading its own rows; the tables' ids gathered across them; each table's devices on both
    # hosts): the losses of the 2 hosts going on from the same checkpoint with row-split tables
    alone = str(tmp_path / "alone")
    shutil.copytree(model_dir, alone)
    command = [a.replace("--mode=eval", "--mode=train").replace("train.steps=4", "train.steps=6") for a in command]
    proc = subprocess.run(command + ["--gin_param=sharding.tables='whole'"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = losses(model_dir)
    assert sorted(trained)[-2:] == [5, 6] and all(np.isfinite(v) for v in trained.values())
    proc = subprocess.run([a.replace(f"--model_dir={model_dir}", f"--model_dir={alone}") for a in command], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    np.testing.assert_allclose([trained[s] for s in (5, 6)], [losses(alone)[s] for s in (5, 6)], rtol=2e-5)


@pytest.mark.unit
def test_planner_counts_tables_slots_and_lookup_traffic():
    """The MLPerf configuration planned on 8 H100s: each device holds 1/8 of the tables and of
    their Adagrad accumulators, no dense table gradient, the lookups' reduction over `model`;
    with the tables placed whole, the most loaded device's tables (the largest alone); --mesh=auto's
    search refuses layouts tables cannot train with, weighs both placements and picks one that fits."""
    from tfpod import plan
    from tfpod.api import load_configs
    from tfpod.plan.search import search
    from tfpod.plan.devices import get
    from tfpod.plan.planner import Planner

    configs = load_configs(["gin/dlrm_dcnv2.gin"], [], "")
    p = plan.predict(configs, "data:1,model:8", "h100", 8)["plan"]
    table_bytes = sum(configs.model.padded_rows) * 128 * 4
    assert p["breakdown"]["tables"] == {"count": 26, "weights": table_bytes // 8, "slots": table_bytes // 8,
                                        "placement": "rows"}
    # tables placed whole: a device holds the tables at its position, the most loaded one counted
    from tfpod.embedding import whole

    placed = plan.predict(load_configs(["gin/dlrm_dcnv2.gin"], ["sharding.tables='whole'"], ""), "data:1,model:8",
                          "h100", 8)["plan"]["breakdown"]["tables"]
    sizes = {str(t): r * 128 * 4 for t, r in enumerate(configs.model.padded_rows)}
    load = collections.Counter()
    for t, position in whole.positions(sizes, 8).items():
        load[position] += sizes[t]
    assert placed == {"count": 26, "weights": max(load.values()), "slots": max(load.values()), "placement": "whole"}
    assert max(load.values()) == max(sizes.values()) > table_bytes // 8  # the largest table alone
    assert p["per_device_bytes"]["gradients"] < 100 * 2**20  # the MLPs' alone
    assert "all_reduce over 'model' (activations)" in p["breakdown"]["time"]["collectives"]
    assert not plan.predict(configs, "data:8", "h100", 8)["fits"]  # replicated tables do not fit
    best, top = search(Planner(configs, get("h100"), 8))
    assert best["fits"] and best["preset"] in ("tensor", "2d") and "model" in best["mesh"]
    assert {p["breakdown"]["tables"]["placement"] for p in top} == {"rows", "whole"}  # both placements weighed
