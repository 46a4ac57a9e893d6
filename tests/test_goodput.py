"""Goodput over a run's launches (tfpod.goodput): model_dir/goodput.json and metrics.jsonl's records."""

import json
import os
import subprocess
import time

import numpy as np
import pytest

from conftest import ROOT, device_mesh, main_command
from test_multihost import SMALL

from tfpod import api, checkpoint, goodput

PARAMS = SMALL + ["train.synthetic_data=True", "train.steps_per_loop=1", "train.checkpoint_every=2",
                  "train.async_checkpoint=True", "train.keep_checkpoints=2"]


def test_goodput_counts_every_launch_and_the_steps_a_restart_trains_again(tmp_path, caplog):
    """Both launches save asynchronously: the resumed steps also show that its checkpoints resume exactly."""
    caplog.set_level("INFO", logger="tfpod")
    d = str(tmp_path)
    api.run(["gin/lm_tiny.gin"], PARAMS + ["train.steps=6"], d, mesh=device_mesh())
    assert "writing checkpoint" in caplog.text and "written in the background" in caplog.text
    # keep_checkpoints=2: a checkpoint counts (and the oldest goes) once it is whole
    assert checkpoint.complete_steps(os.path.join(d, "checkpoints")) == [4, 6]
    first = json.load(open(os.path.join(d, "goodput.json")))["launches"]
    assert len(first) == 1 and first[0]["first_step"] == 0 and first[0]["last_step"] == 6
    assert first[0]["compile_s"] > 0 and first[0]["productive_s"] > 0 and first[0]["checkpoint_s"] > 0
    assert "goodput " in caplog.text and "badput: startup" in caplog.text
    # The newest checkpoint is lost (as when a host dies before it is written): the next
    # launch resumes from step 4 and trains steps 5 and 6 again.
    for f in os.listdir(os.path.join(d, "checkpoints")):
        if f.startswith("ckpt-6"):
            os.remove(os.path.join(d, "checkpoints", f))
    # A launch killed before it restored anything (while TensorFlow loads) records nothing
    # itself: its time is badput between the launches.
    started = time.time()
    command = main_command("--gin_file=gin/lm_tiny.gin", "--cpu_devices=1", "--mesh=data:1,model:1", f"--model_dir={d}",
                           *[f"--gin_param={p}" for p in PARAMS + ["train.steps=8"]])
    killed = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)
    killed.kill()
    killed.wait()
    dead = time.time() - started
    api.run(["gin/lm_tiny.gin"], PARAMS + ["train.steps=8"], d, mesh=device_mesh())
    launches = json.load(open(os.path.join(d, "goodput.json")))["launches"]
    assert [(l["first_step"], l["last_step"]) for l in launches] == [(0, 6), (4, 8)]
    summary = goodput.summarize(launches)
    lost = launches[0]["productive_s"] * 2 / 6  # steps 5 and 6 of the first launch
    assert summary["badput"]["lost_to_restarts"] == pytest.approx(lost / summary["wall_s"])
    assert summary["wall_s"] == pytest.approx(launches[1]["last"] - launches[0]["start"])
    assert summary["badput"]["between_launches"] * summary["wall_s"] >= dead
    assert 0 < summary["goodput"] < 1
    assert summary["goodput"] + sum(summary["badput"].values()) == pytest.approx(1.0)
    records = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    trained = [(r["step"], r["loss"]) for r in records if r["kind"] == "train" and r["step"] in (5, 6)]
    assert [s for s, _ in trained] == [5, 6, 5, 6]  # before the lost checkpoint, and again after the restart
    np.testing.assert_allclose([l for _, l in trained[2:]], [l for _, l in trained[:2]], rtol=1e-6)
    good = [r for r in records if r["kind"] == "goodput"]
    assert good[-1]["launches"] == 2 and good[-1]["step"] == 8
    assert good[-1]["goodput"] == pytest.approx(summary["goodput"], rel=0.05)
    assert set(good[-1]["badput"]) == set(goodput.CAUSES)
