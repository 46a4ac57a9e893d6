"""The fault injector (tfpod/faults.py): what each kind does, once per run folder; and a run
under a supervisor that survives several kinds and ends as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, device_mesh, main_command
from tfpod import UserError, faults
from tfpod.api import run


def injector(tmp_path, text, host=0, num_hosts=2, steps=20):
    return faults.Injector(str(tmp_path), host, num_hosts, steps, text)


@pytest.mark.unit
def test_entries_parse_and_bad_ones_are_one_line():
    assert faults.parse("kill@6,hang@9:1,slow@3=0.5", 20, 2) == [
        faults.Fault("kill", 6), faults.Fault("hang", 9, 1), faults.Fault("slow", 3, None, 0.5)]
    drawn = faults.parse("random:7:30", 100, 2)
    assert len(drawn) == 30 and drawn == faults.parse("random:7:30", 100, 2)  # seeded
    assert {f.kind for f in drawn} == set(faults.KINDS) - {"slow"} and all(2 <= f.step <= 100 for f in drawn)
    for bad, message in (("boom@3", "the kinds are exception, kill"), ("kill", "is not KIND@STEP"),
                         ("kill@30", r"the step must be in 1..20"), ("kill@3:2", r"host in 0..1"),
                         ("random:x", "random:SEED:COUNT")):
        with pytest.raises(UserError, match=message):
            faults.parse(bad, 20, 2)


@pytest.mark.unit
def test_each_fault_fires_once_per_run_folder_on_its_host(tmp_path):
    batch = {"inputs": np.zeros([4, 2, 3], np.int32), "weights": np.ones([4, 2, 3], np.float32)}
    other = injector(tmp_path, "exception@3:1,nonfinite@6")
    assert [f.name for f in other.pending] == ["nonfinite@6"]  # host 0: host 1's fault is not its own
    one = injector(tmp_path, "exception@3:0,nonfinite@6")
    assert one.before_call(0, 2, batch) is batch  # steps 1..2: nothing due
    with pytest.raises(RuntimeError, match="fault injected: exception@3:0"):
        one.before_call(2, 2, batch)
    poisoned = one.before_call(4, 4, batch)  # steps 5..8: step 6's weights are NaN
    assert np.isnan(poisoned["weights"][1]).all() and not np.isnan(poisoned["weights"][[0, 2, 3]]).any()
    assert not np.isnan(batch["weights"]).any()  # (a copy)
    assert json.load(open(tmp_path / "faults-host0.json")) == ["exception@3:0", "nonfinite@6"]
    again = injector(tmp_path, "exception@3:0,nonfinite@6")  # a restarted run goes past them
    assert again.pending == [] and again.before_call(2, 4, batch) is batch
    failing = injector(tmp_path, "ckpt_fail@4", host=1)
    failing.at_save(2, str(tmp_path / "ckpt-2"), written=False)
    with pytest.raises(OSError, match="No space left on device"):
        failing.at_save(4, str(tmp_path / "ckpt-4"), written=False)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["kill", "ckpt_truncate", "hang"])
def test_kill_torn_checkpoint_and_hang_end_the_process(tmp_path, kind):
    """Each in a process of its own: SIGKILL; a checkpoint's data cut to half, then SIGKILL; a
    hang that the watchdog ends with status 124."""
    (tmp_path / "ckpt-4.data-00000-of-00001").write_bytes(b"x" * 100)
    script = f"""
import sys
sys.path.insert(0, {ROOT!r})
from tfpod import faults, watchdog
w = watchdog.Watchdog(timeout_s=0.5, factor=10.0, min_s=0.5)
i = faults.Injector({str(tmp_path)!r}, 0, 1, 20, "{kind}@4")
w.before_call(3, 1)
i.at_save(4, {str(tmp_path / 'ckpt-4')!r}, written=True)
i.before_call(3, 1, {{}})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == {"kill": -signal.SIGKILL, "ckpt_truncate": -signal.SIGKILL, "hang": 124}[kind], \
        proc.stderr[-2000:]
    size = os.path.getsize(tmp_path / "ckpt-4.data-00000-of-00001")
    assert size == (50 if kind == "ckpt_truncate" else 100)


def test_a_run_survives_injected_faults_under_the_launcher_and_ends_as_an_uninterrupted_one(tmp_path):
    """TFPOD_FAULT=exception@3,nonfinite@5,ckpt_truncate@8,ckpt_fail@10 on main.py under
    tfpod.launch --max_restarts=4 (1 host of 2 devices): each fault ends a launch (exit 1,
    SIGKILL after a torn checkpoint), the launcher starts it again, the torn checkpoint is set
    aside, and the run ends with the losses and weights of an uninterrupted run."""
    params = ["gpt.num_layers=1", "gpt.embed_dim=64", "gpt.mlp_dim=128", "train.global_batch_size=8",
              "train.synthetic_data=True", "train.steps_per_loop=1", "train.log_every=1",
              "train.checkpoint_every=2", "train.steps=12", "optimizer.warmup_steps=0"]
    d = tmp_path / "run"
    cmd = [sys.executable, "-m", "tfpod.launch", "--num_hosts=1", "--devices_per_host=2", "--max_restarts=4",
           "--restart_backoff_s=0.1", "--", *main_command("--gin_file=gin/lm_tiny.gin", "--mesh=data:2",
                                                          f"--model_dir={d}", *[f"--gin_param={p}" for p in params])]
    env = dict(os.environ, TFPOD_FAULT="exception@3,nonfinite@5,ckpt_truncate@8,ckpt_fail@10")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stderr.count("starting every host again") == 4
    for name in ("exception@3", "nonfinite@5", "ckpt_truncate@8", "ckpt_fail@10"):
        assert f"fault injected: {name} on host 0" in proc.stdout
    assert "loss became nan at step 5" in proc.stdout and "No space left on device" in proc.stdout
    assert list((d / "checkpoints").glob("ckpt-8.corrupt*"))  # the torn one, set aside
    from test_reliability import assert_same_checkpoint
    from test_multihost import logged_losses

    run(["gin/lm_tiny.gin"], params, str(tmp_path / "one"), mesh=device_mesh("data:2"))
    reference, resumed = logged_losses(tmp_path / "one"), logged_losses(d)
    assert sorted(resumed) == list(range(1, 13))
    np.testing.assert_array_equal([resumed[s] for s in range(1, 13)], [reference[s] for s in range(1, 13)])
    assert_same_checkpoint(str(d / "checkpoints" / "ckpt-12"), str(tmp_path / "one" / "checkpoints" / "ckpt-12"))
