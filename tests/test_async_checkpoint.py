"""train.async_checkpoint=True: checkpoints written in a background thread while training goes on
(tests/test_goodput.py also trains with it and resumes from its checkpoints)."""

import glob
import json
import os
import signal
import subprocess
import time

import numpy as np

from conftest import ROOT, main_command
from test_multihost import SMALL

from tfpod import checkpoint

SYNTHETIC = SMALL + ["train.synthetic_data=True", "train.steps_per_loop=1", "train.checkpoint_every=1"]


def test_kill9_while_a_checkpoint_is_written_resumes_from_the_one_before(tmp_path):
    """A wider model (a ~25 MB checkpoint) whose background write is caught in progress."""
    wide = ["gpt.embed_dim=256", "gpt.mlp_dim=1024", "gpt.num_layers=2", "train.async_checkpoint=True"]
    args = ["--gin_file=gin/lm_tiny.gin", "--cpu_devices=8", "--mesh=data:4,model:2"]
    params = [f"--gin_param={p}" for p in SYNTHETIC + wide]
    d = tmp_path / "run"
    proc = subprocess.Popen(main_command(*args, f"--model_dir={d}", *params, "--gin_param=train.steps=200"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, caught = time.time() + 300, None
    while time.time() < deadline and caught is None:
        writing = glob.glob(str(d / "checkpoints" / "ckpt-*_temp*"))
        done = checkpoint.complete_steps(str(d / "checkpoints")) if os.path.isdir(d / "checkpoints") else []
        if writing and done:  # a write in progress, with a complete one before it
            os.kill(proc.pid, signal.SIGKILL)
            caught = (writing, done)
        time.sleep(0.005)
    proc.wait(timeout=60)
    assert caught, "no checkpoint write was caught in progress"
    newest = checkpoint.complete_steps(str(d / "checkpoints"))[-1]
    written = int(os.path.basename(caught[0][0]).split("_temp")[0].split("-")[1])
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


def test_several_hosts_refuse_asynchronous_checkpoints_in_one_line(tmp_path):
    from conftest import launch_command

    cmd = launch_command(2, 4, "--gin_file=gin/lm_tiny.gin", "--mesh=data:8", f"--model_dir={tmp_path}",
                         *[f"--gin_param={p}" for p in SYNTHETIC + ["train.steps=2", "train.async_checkpoint=True"]])
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "error: train.async_checkpoint=True with 2 hosts" in out.stderr + out.stdout
    assert not os.path.exists(tmp_path / "checkpoints" / "checkpoint")  # nothing was written
