"""Keras 3's distribution API on 2 local hosts x 4 devices (tfpod.launch, tfpod/keras3/): the
guide's ModelParallel example (examples/keras3_fit.py) fits with one device's losses, is
stopped after its second epoch, and resumes from keras.callbacks.BackupAndRestore to the same
final weights as one device trained straight through (float32: 2e-5 relative, 2e-6 absolute)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tfpod  # noqa: F401
from conftest import ROOT

keras = pytest.importorskip("keras")


def _example():
    spec = importlib.util.spec_from_file_location("keras3_fit", os.path.join(ROOT, "examples", "keras3_fit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(*args):
    from tfpod import console

    command = [sys.executable, "-m", "tfpod.launch", "--num_hosts=2", "--devices_per_host=4", "--",
               sys.executable, "examples/keras3_fit.py", "--epochs=4", "--dropout=0", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=console.child_env())


def _epochs(out) -> dict[int, float]:
    """Host 0's per-epoch losses (JSON lines)."""
    lines = [l.split("] ", 1)[1] for l in out.stdout.splitlines() if l.startswith("[host 0] {\"epoch\"")]
    return {r["epoch"]: r["loss"] for r in map(json.loads, lines)}


def test_two_hosts_fit_with_one_devices_losses_and_resume_from_backup(tmp_path):
    backup, weights = str(tmp_path / "backup"), str(tmp_path / "weights.npz")
    stopped = _launch(f"--backup_dir={backup}", "--stop_after_epoch=2")
    assert stopped.returncode != 0 and "preempted after epoch 2" in stopped.stdout + stopped.stderr
    resumed = _launch(f"--backup_dir={backup}", f"--weights={weights}")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    last = json.loads(resumed.stdout.splitlines()[-1].split("] ", 1)[1])
    assert last["hosts"] == 2 and last["epochs"] == [2, 3]  # resumed after epoch 2
    losses = {**_epochs(stopped), **_epochs(resumed)}

    example = _example()
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(1)
    model = example.build_model(0.0)  # one device: no distribution
    history = model.fit(example.make_data(), epochs=4, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose([losses[e] for e in (1, 2, 3, 4)], history, rtol=2e-5, atol=2e-6)
    saved = np.load(weights)
    for i, w in enumerate(model.get_weights()):
        np.testing.assert_allclose(saved[f"arr_{i}"], w, rtol=2e-5, atol=2e-6)
    assert not os.path.exists(backup)  # host 0 deleted the backup at the end of training
