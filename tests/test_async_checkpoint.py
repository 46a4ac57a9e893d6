"""train.async_checkpoint=True: checkpoints written in a background thread while training goes on
(tests/test_goodput.py also trains with it and resumes from its checkpoints; test_multihost
writes one from 2 hosts and resumes from it)."""

import glob
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import ROOT, main_command
from test_multihost import SYNTHETIC

from tfpod import checkpoint


def step_of(temp: str) -> int:
    return int(os.path.basename(temp).split("_temp")[0].split("-")[1])


def test_kill9_while_a_checkpoint_is_written_resumes_from_the_one_before(tmp_path):
    """A wider model (a ~25 MB checkpoint) whose background write is caught in progress."""
    wide = ["gpt.embed_dim=256", "gpt.mlp_dim=1024", "gpt.num_layers=2", "train.async_checkpoint=True"]
    # Two devices, weights split over model: a write of several shards caught in progress.
    args = ["--gin_file=gin/lm_tiny.gin", "--cpu_devices=2", "--mesh=data:1,model:2"]
    params = [f"--gin_param={p}" for p in SYNTHETIC + wide]
    d = tmp_path / "run"
    proc = subprocess.Popen(main_command(*args, f"--model_dir={d}", *params, "--gin_param=train.steps=200"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, caught = time.time() + 300, None
    while time.time() < deadline and caught is None:
        done = checkpoint.complete_steps(str(d / "checkpoints")) if os.path.isdir(d / "checkpoints") else []
        writing = [w for w in glob.glob(str(d / "checkpoints" / "ckpt-*_temp")) if step_of(w) not in done]
        if writing and done:  # a write in progress, with a complete one before it
            os.kill(proc.pid, signal.SIGKILL)
            caught = (writing, done)
        time.sleep(0.005)
    proc.wait(timeout=60)
    assert caught, "no checkpoint write was caught in progress"
    newest = checkpoint.complete_steps(str(d / "checkpoints"))[-1]
    written = step_of(caught[0][0])
    assert newest < written  # the interrupted one is not complete; the one before it is the newest
    run = subprocess.run(main_command(*args, f"--model_dir={d}", *params, f"--gin_param=train.steps={written}"),
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"resumed from {d}/checkpoints/ckpt-{newest}" in run.stderr + run.stdout
    # Steps newest+1 .. written trained before the kill and again after it: the same losses.
    records = [json.loads(line) for line in open(d / "metrics.jsonl")]
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train" and newest < r["step"] <= written]
    before, after = train[:written - newest], train[written - newest:]
    assert [s for s, _ in before] == [s for s, _ in after] == list(range(newest + 1, written + 1))
    np.testing.assert_allclose([l for _, l in after], [l for _, l in before], rtol=1e-6)


def small_run(model_dir, mesh, preset, blocks=1, **sharding):
    """A Controller of test_train's small gpt with `blocks` blocks for 2 steps (a save only at the end)."""
    from conftest import make_run
    from test_train import SMALL as SMALL_GPT

    from tfpod import optimizers
    from tfpod.controller import TrainConfig
    from tfpod.models import gpt

    train = TrainConfig(steps=2, global_batch_size=16, steps_per_loop=2, log_every=2, checkpoint_every=100,
                        synthetic_data=True, seed=1)
    opt = optimizers.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, decay_steps=8)
    return make_run(gpt.TASK, gpt.GPTConfig(**{**SMALL_GPT, "num_layers": blocks}), train, opt, mesh, model_dir,
                    preset=preset, **sharding)


def write_both_ways(tmp_path, mesh, preset, blocks, **sharding):
    """One trained state written by TensorFlow's own sharded save (tf/), tfpod's synchronous
    save (sync/) and its background writer (async/): (TensorFlow's path, the background
    one, the run, the save count the background save wrote)."""
    import tensorflow as tf

    run = small_run(tmp_path / "sync", mesh, preset, blocks, **sharding)
    run.train()  # its last step is saved synchronously
    ours, saves = str(tmp_path / "sync" / "checkpoints" / "ckpt-2"), int(run.checkpoints._ckpt.save_counter.numpy())
    with run.checkpoints._mesh():  # DTensor's SaveV2 on the mesh, as tf.train.Checkpoint writes it
        reference = tf.train.CheckpointManager(run.checkpoints._ckpt, str(tmp_path / "tf"), 1).save(2)
    assert_same_checkpoint(reference, ours, saves)
    background = checkpoint.CheckpointManager(str(tmp_path / "async"), run.trainer.state, async_save=True)
    path = background.save()
    counted = int(background._ckpt.save_counter.numpy())  # what this save wrote (read before anything else runs)
    background.wait()
    return reference, path, run, counted


def assert_same_checkpoint(sync, background, saves: int):
    """`background` holds the same keys, shapes and values as `sync` (the object graph too),
    and save_counter `saves` (each manager counts its own saves)."""
    import tensorflow as tf

    assert dict(tf.train.list_variables(background)) == dict(tf.train.list_variables(sync))
    a, b = tf.train.load_checkpoint(sync), tf.train.load_checkpoint(background)
    for key in a.get_variable_to_shape_map():  # every variable, optimizer slot, the step and the object graph
        if key.startswith("save_counter/"):
            assert b.get_tensor(key) == saves
        else:
            np.testing.assert_array_equal(b.get_tensor(key), a.get_tensor(key), err_msg=key)


@pytest.mark.parametrize("mesh,preset", [("data:2,model:4", "2d"), ("stage:2,data:2,model:2", "tensor")],
                         ids=["2d", "pipeline"])
def test_synchronous_and_background_checkpoints_hold_what_tensorflows_own_save_does_and_restore_elsewhere(
        tmp_path, mesh, preset):
    """gpt on data:2,model:4 with the 2d preset (weights split over both axes, replicated
    norms, sharded optimizer slots), and in 2 pipeline stages (each stage's variables on its
    own mesh): each distinct shard written once, by the device that owns it."""
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    from tfpod import runtime

    blocks = 2 if mesh.startswith("stage:") else 1  # a block per pipeline stage
    sync, background, run, counted = write_both_ways(tmp_path, mesh, preset, blocks)
    assert_same_checkpoint(sync, background, counted)
    # one host's part, merged; nothing temporary left
    assert sorted(os.listdir(tmp_path / "async" / "checkpoints")) == ["checkpoint", "ckpt-2.data-00000-of-00001",
                                                                     "ckpt-2.index"]
    assert tf.train.latest_checkpoint(str(tmp_path / "async" / "checkpoints")) == background
    # A run on another mesh and preset resumes from it with the same weights.
    other = small_run(tmp_path / "async", "data:8", "data", blocks)
    assert other.checkpoints.restore_latest() == 2
    whole = lambda v: runtime.to_host(dtensor.relayout(v.read_value(), dtensor.Layout.replicated(
        dtensor.fetch_layout(v.read_value()).mesh, len(v.shape))))
    mine = {v.name: v for v in other.trainer.model.weights}
    for v in run.trainer.model.weights:
        np.testing.assert_array_equal(whole(mine[v.name]), whole(v), err_msg=v.name)


EXIT_WHILE_WRITING = """
import sys
from tfpod import checkpoint, runtime
from tfpod.train_state import TrainState
runtime.initialize(cpu_devices=8)
import tensorflow as tf
from tensorflow.experimental import dtensor
mesh = dtensor.create_mesh([("data", 2), ("model", 4)], device_type="CPU")
layout = dtensor.Layout(["unsharded", "model"], mesh)
module = tf.Module()
module.weights = [dtensor.DVariable(dtensor.call_with_layout(tf.ones, layout, [4000, 4000])) for _ in range(4)]
step = dtensor.DVariable(dtensor.call_with_layout(tf.fill, dtensor.Layout.replicated(mesh, 0), [], tf.constant(5, tf.int64)))
checkpoint.CheckpointManager(sys.argv[1], TrainState(step, module), async_save=True).save()
raise SystemExit("stopped by an error while a checkpoint is written")
"""


def test_a_process_stopped_by_an_error_finishes_its_background_write(tmp_path):
    """One host: a run that leaves on an error (not kill -9) still completes the checkpoint in flight."""
    import sys

    out = subprocess.run([sys.executable, "-c", EXIT_WHILE_WRITING, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1 and "stopped by an error" in out.stderr
    assert checkpoint.complete_steps(str(tmp_path / "checkpoints")) == [5]
    assert "model_checkpoint_path: \"ckpt-5\"" in open(tmp_path / "checkpoints" / "checkpoint").read()
