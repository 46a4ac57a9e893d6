"""The real command line: a smoke run of main.py, resume by rerun, and one-line errors."""

import json
import os
import re
import shlex
import subprocess
import time

import pytest

from conftest import ROOT, main_command, main_py
from tfpod import UserError, console
from tfpod.api import run
from tfpod.config import resolve_gin_file



def test_default_job_trains_logs_and_checkpoints(tmp_path):
    """Run as the README's Quick start line often is, behind a shell that works first and then
    execs python (`sh -c "pip install ... && python main.py ..."`, container entrypoints): the
    process, and its start in /proc, are the shell's, but goodput counts from the interpreter's
    start. (Relaunching main.py after kill -9 or SIGTERM resumes exactly: test_reliability.)"""
    d = tmp_path / "lm_tiny"
    base = ["--gin_file=gin/lm_tiny.gin", "--cpu_devices=8", "--mesh=data:4,model:2", f"--model_dir={d}",
            "--gin_param=train.checkpoint_every=10", "--gin_param=train.log_every=10"]
    production = console.child_env({**os.environ, "TFPOD_GRAPH_OPTIMIZATIONS": "1"})  # as users run it
    shell = f"sleep 3 && exec {shlex.join(main_command(*base, '--gin_param=train.steps=20'))}"
    before = time.time()
    first = subprocess.run(["sh", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=600, env=production)
    assert first.returncode == 0, first.stderr[-3000:]
    launch = json.load(open(d / "goodput.json"))["launches"][0]
    assert launch["start"] >= before + 3, (launch["start"] - before)  # not the shell's 3 s of work
    assert launch["startup_s"] < launch["last"] - before - 3
    log = first.stderr
    assert "mesh data:4,model:2 (8 CPU devices); global batch 16; per-device batch 4" in log
    assert "tokens per step 1024" in log
    assert "step 20/20 | loss" in log and "tokens/s" in log and "mfu" in log and "eta" in log
    assert "trained steps 0..20 in " in log and "step 20's own loss " in log  # the last line: not a window's mean
    # The console is tfpod's: timestamped lines and the layout summary, no start-up noise of TensorFlow's
    # (the CUDA probe, oneDNN, absl's pre-init warning, Grappler's cost model while the step compiles).
    assert "layouts (every variable:" in log and "# total: 36 variables" in log
    others = [line for line in log.splitlines() if not re.match(r"\d\d:\d\d:\d\d |# ", line)]
    assert not others, others
    records = [json.loads(l) for l in open(d / "metrics.jsonl")]
    records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in records] == [10, 20]
    assert records[-1]["loss"] < records[0]["loss"]  # falling loss
    assert "train.steps = 20" in open(d / "config.gin").read()
    assert "gpt.num_heads = 8" in open(d / "config.gin").read()
    assert "# total: 36 variables" in open(d / "layouts.txt").read()
    ckpts = sorted(f for f in os.listdir(d / "checkpoints") if f.endswith(".index"))
    assert ckpts == ["ckpt-10.index", "ckpt-20.index"]


def test_bad_mesh_is_one_line_and_nonzero(tmp_path):
    proc = main_py("--gin_file=gin/lm_tiny.gin", "--cpu_devices=8", "--mesh=data:3", f"--model_dir={tmp_path}")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "error: --mesh='data:3' has 3 devices but the job has 8: make the sizes multiply to 8 (or use -1 on one axis)"
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "params,mode,needle",
    [
        (["train.stepz=3"], "train", "gin config"),
        (["gpt.num_heads=7"], "train", "gpt.embed_dim=128 is not divisible by gpt.num_heads=7"),
        (["optimizer.name='adam2'"], "train", "optimizer.name='adam2' is not known"),
        (["sharding.preset='megatron'"], "train", "sharding.preset='megatron' is not a preset"),
        (["lm_data.seq_len=65"], "train", "lm_data.seq_len=65 is outside [1, 64]"),
        (["lm_data.train_files='/nonexistent/*.tfrecord'", "lm_data.vocab_path='/nonexistent.model'"], "train",
         "input pattern '/nonexistent/*.tfrecord' matches no file"),
        ([], "eval", "--mode=eval: no checkpoints in"),
        (["train.synthetic_data=True"], "eval", "--mode=eval needs eval data"),
        ([], "export", "--mode=export: no complete checkpoint in"),
    ],
)
@pytest.mark.unit
def test_config_errors_are_one_clear_line(tmp_path, params, mode, needle):
    with pytest.raises(UserError) as e:
        run(["gin/lm_tiny.gin"], params, str(tmp_path), mode=mode, mesh_spec="data:4,model:2")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
def test_gin_files_resolve_from_the_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: found through tfpod's gin folder
    assert resolve_gin_file("gin/lm_tiny.gin").endswith(os.path.join("gin", "lm_tiny.gin"))
    assert resolve_gin_file("gpt_small.gin").endswith(os.path.join("gin", "gpt_small.gin"))
    with pytest.raises(UserError, match="no such file .*lm_tiny.gin"):
        resolve_gin_file("gin/nope.gin")


@pytest.mark.unit
def test_required_values_must_be_set(tmp_path):
    bare = tmp_path / "bare.gin"
    bare.write_text("include 'run/base.gin'\ninclude 'model/gpt_tiny.gin'\ntrain.synthetic_data = True\n")
    with pytest.raises(UserError) as e:
        run([str(bare)], [], str(tmp_path / "out"), mesh_spec="data:8")
    assert str(e.value) == (
        "train.steps is required and unset: bind it in your gin file or pass --gin_param=train.steps=VALUE"
    )
