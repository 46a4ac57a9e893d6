"""One writer per run folder (tfpod.run_folder), and damaged files in a run folder.

Two runs started at once on one folder: one is refused with a line naming the holder,
the other trains the losses of a lone run and leaves only readable checkpoints. On 2
local hosts, every host of a refused job stops with the line; a killed 2-host job's
relaunch takes its stale claim over with one warning (test_pipeline's kill -9 test). Every file tfpod reads back (plan.json, goodput.json, input
positions, config.gin, the checkpoint list, a checkpoint's files) that is damaged is
one line naming it, and a damaged checkpoint is moved aside.
"""

import glob
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, device_mesh, main_command
from test_multihost import SMALL, errors, losses, main_args

from tfpod import UserError, api, checkpoint, config, run_folder

PY = [sys.executable, "-c"]
# A process that takes a folder and holds it until killed (no TensorFlow: quick).
HOLD = ("import sys, time; from tfpod import run_folder; run_folder.take(sys.argv[1]); print('held', flush=True); "
        "time.sleep(600)")
TAKE = "import sys; from tfpod import run_folder; run_folder.take(sys.argv[1]).release(); print('taken')"


def _python(code, *args, **kw):
    return subprocess.run(PY + [code, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=60, **kw)


def _holder(**fields):
    now = time.time()
    return {"job": "abcdef", "hosts": 2, "machine": "gpu-node-17", "boot": "another-boot", "pid": 4242,
            "pid_start": "1", "since": now - 3600, "beat": now, "command": "main.py --gin_file=gin/gpt.gin", **fields}


@pytest.mark.unit
def test_a_live_holder_refuses_others_and_a_gone_one_is_taken_over(tmp_path, caplog, monkeypatch):
    d = str(tmp_path)
    # A live process on this machine holds the folder: another process is refused, naming it.
    holder = subprocess.Popen(PY + [HOLD, d], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = _python(TAKE, d)
        assert refused.returncode != 0 and "UserError" in refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert f"--model_dir={d} is in use by another run" in line
        assert f"process {holder.pid} on machine {socket.gethostname()}" in line and "since 20" in line
        assert "pass another --model_dir" in line
        claim = json.load(open(tmp_path / "claim.json"))
        assert claim["pid"] == holder.pid and claim["hosts"] == 1
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # Killed: its claim stays behind, and the next run takes it over with one warning.
    assert os.path.exists(tmp_path / "claim.json")
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        claim = run_folder.take(d)
    assert f"process {holder.pid}" in caplog.text and "its process is gone" in caplog.text
    assert "taking it over" in caplog.text
    assert run_folder.take(d) is claim  # this process holds it: its own claim back
    claim.release()
    assert not os.path.exists(tmp_path / "claim.json")

    # Another machine's claim (a shared filesystem): live while refreshed, stale after TFPOD_CLAIM_STALE_S.
    path = tmp_path / "claim.json"
    path.write_text(json.dumps(_holder()))
    with pytest.raises(UserError, match=r"in use by another run \(job abcdef, host 0 of 2 \(process 4242 on machine "
                                        r"gpu-node-17, `main.py --gin_file=gin/gpt.gin`\), since .*last seen 0 s ago"):
        run_folder.take(d)
    path.write_text(json.dumps(_holder(beat=time.time() - 61)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        run_folder.take(d).release()
    assert "gpu-node-17" in caplog.text and "not refreshed for 61 s" in caplog.text
    # This machine's name but an earlier boot: the machine restarted, so its holder is gone.
    path.write_text(json.dumps(_holder(machine=socket.gethostname(), pid=os.getpid())))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        run_folder.take(d).release()
    assert "its machine restarted since" in caplog.text
    # A damaged claim.json holds nothing.
    path.write_text("{not json")
    run_folder.take(d).release()

    # A holder that stalled past the stale time finds its folder taken over: it stops at its next checkpoint.
    monkeypatch.setattr(run_folder, "HEARTBEAT_S", 0.05)
    claim = run_folder.take(d)
    path.write_text(json.dumps(_holder()))  # another run took it over
    deadline = time.time() + 10
    while claim.lost is None and time.time() < deadline:
        time.sleep(0.05)
    with pytest.raises(UserError, match="another run took over .* this run stops without writing more"):
        run_folder.check_held(d)
    claim.release()
    assert json.load(open(path))["job"] == "abcdef"  # the other run's claim is left alone


def _start_two(cmd):
    """Starts `cmd` twice at once; (the finished processes, their outputs)."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    return procs, outs


def _assert_one_refused_one_whole(procs, outs, d, reference):
    codes = sorted(p.returncode for p in procs)
    assert codes[0] == 0 and codes[1] != 0, [errors(subprocess.CompletedProcess([], p.returncode, *o))
                                             for p, o in zip(procs, outs)]
    refused = outs[[p.returncode for p in procs].index(codes[1])]
    assert f"--model_dir={d} is in use by another run" in refused[0] + refused[1]
    assert "saved checkpoint" not in refused[0] + refused[1]
    complete, damaged = checkpoint.scan(str(d / "checkpoints"))
    assert complete == [2, 4] and damaged == []
    for step in complete:
        checkpoint.verify(str(d / "checkpoints" / f"ckpt-{step}"))  # every tensor reads, checksums hold
    steps = [json.loads(l)["step"] for l in open(d / "metrics.jsonl") if json.loads(l)["kind"] == "train"]
    assert steps == [1, 2, 3, 4]  # every step once
    np.testing.assert_allclose(losses(d), reference, rtol=1e-5)
    assert not os.path.exists(d / "claim.json")  # given back at the end


PARAMS = ["train.steps=4", "train.checkpoint_every=2"]


def test_two_runs_at_once_on_one_folder_one_host(tmp_path):
    d = tmp_path / "run"
    args = main_args(d, 4, ["train.checkpoint_every=2"], mesh="data:1,model:1")  # the folder is the point
    procs, outs = _start_two(main_command("--cpu_devices=1", *args))
    reference = api.run(["gin/lm_tiny.gin"], SMALL + PARAMS, str(tmp_path / "lone"), mesh=device_mesh())
    _assert_one_refused_one_whole(procs, outs, d, reference["losses"])


def test_a_refused_job_stops_on_every_host(tmp_path):
    """2-host jobs: every host of a refused job stops with the line."""
    from tfpod.launch import free_ports, host_env

    d = tmp_path / "run"
    # A live claim of another machine's run: both hosts (no launcher to stop them) refuse.
    os.makedirs(d)
    (d / "claim.json").write_text(json.dumps(_holder()))
    ports = free_ports(2)
    cmd = main_command(*main_args(d, 4))
    hosts = [subprocess.Popen(cmd, cwd=ROOT, env=host_env(h, 2, ports, 4), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for h in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in hosts]
    assert [p.returncode for p in hosts] == [1, 1], outs
    assert "is in use by another run (job abcdef, host 0 of 2 (process 4242 on machine gpu-node-17" in outs[0]
    assert f"error: --model_dir={d} is in use by another run (host 0 names it)" in outs[1]

    # (Two jobs started at once race for the claim as two 1-host runs do, above: host 0 of
    # each takes it as a lone run's process does, and the refusal reaches every host as here.
    # A killed 2-host job's claim taken over by its relaunch: test_pipeline's kill -9 test.)


# -- damaged files --------------------------------------------------------------------------

REAL = SMALL + ["train.checkpoint_every=2", "train.keep_checkpoints=3"]


def test_damaged_files_are_one_line_and_damaged_checkpoints_move_aside(tmp_path, caplog):
    """One run, then each file it reads back damaged in turn; the resumed steps repeat the first run's."""
    d = str(tmp_path / "run")
    first = api.run(["gin/lm_tiny.gin"], REAL + ["train.steps=4"], d, mesh=device_mesh())["losses"]
    ckpts = os.path.join(d, "checkpoints")
    # ckpt-4 holds the shards of two writes (as two runs writing at once left it); the
    # checkpoint list and goodput.json are garbage.
    shards = sorted(glob.glob(os.path.join(ckpts, "ckpt-4.data-*")))
    with open(os.path.join(ckpts, f"ckpt-4.data-00000-of-{len(shards) + 1:05d}"), "wb") as f:
        f.write(open(shards[0], "rb").read())
    with open(os.path.join(ckpts, "checkpoint"), "w") as f:
        f.write("model_checkpoint_path: \x00\x01 {{")
    with open(os.path.join(d, "goodput.json"), "w") as f:
        f.write('{"launches": [{"start": 1')
    # A reader (an evaluation beside a live run on another machine) leaves them in place.
    with open(os.path.join(d, "claim.json"), "w") as f:
        json.dump(_holder(), f)
    config.parse_config(["gin/lm_tiny.gin"], REAL + ["train.synthetic_data=True"])
    c = api.build_run_configs()
    session = api.start(c, api.RunOptions(mesh=device_mesh()), d)
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        assert api.controller(c.task, c.model, c.train, c.optimizer, session.placement, d).checkpoints \
            .restore_latest() == 2
    assert "ckpt-4 is damaged" in caplog.text and "left in place, as a live run holds this folder (job abcdef" \
        in caplog.text
    assert checkpoint.scan(ckpts) == ([2], [4]) and not glob.glob(os.path.join(ckpts, "checkpoint.*"))
    os.remove(os.path.join(d, "claim.json"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tfpod"):
        out = api.run(["gin/lm_tiny.gin"], REAL + ["train.steps=6"], d, mesh=device_mesh())
    text = caplog.text
    assert f"checkpoint {ckpts}/ckpt-4 is damaged (its data shards are missing or come from different writes): " \
           f"moved it to {ckpts}/ckpt-4.corrupt.0" in text
    assert os.path.exists(os.path.join(ckpts, "ckpt-4.corrupt.0.index"))
    assert f"{ckpts}/checkpoint is damaged" in text and "rebuilt the list from the 1 complete checkpoint(s)" in text
    assert glob.glob(os.path.join(ckpts, "checkpoint.corrupt.0"))
    assert f"{d}/goodput.json is damaged" in text and os.path.exists(os.path.join(d, "goodput.json.corrupt.0"))
    assert "at step 2" in text and "input resumed at step 2" in text
    np.testing.assert_allclose(out["losses"][:2], first[2:], rtol=1e-6)  # steps 3 and 4 again, from ckpt-2
    assert checkpoint.scan(ckpts) == ([2, 4, 6], [])

    # An input position: what it was built from unreadable, then its own files.
    source = os.path.join(ckpts, "input-host0", "ckpt-6.source.json")
    with open(source, "w") as f:
        f.write("{")
    params = REAL + ["train.steps=7"]
    with pytest.raises(UserError, match=rf"{source} is damaged .*restore the file from a backup.*strict_resume=True"):
        api.run(["gin/lm_tiny.gin"], params + ["train.strict_resume=True"], d, mesh=device_mesh())
    os.remove(source)
    data = glob.glob(os.path.join(ckpts, "input-host0", "ckpt-6.data-*"))[0]
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2: len(raw) // 2 + 16] = bytes(16)
    open(data, "wb").write(bytes(raw))
    with pytest.raises(UserError, match=rf"the input position {ckpts}/input-host0/ckpt-6 is damaged"):
        api.run(["gin/lm_tiny.gin"], params + ["train.strict_resume=True"], d, mesh=device_mesh())

    # config.gin (a run's own config, read when no --gin_file is given).
    saved = os.path.join(d, "config.gin")
    good = open(saved).read()
    with open(saved, "w") as f:
        f.write(good[: len(good) // 2] + "\n((( broken")
    with pytest.raises(UserError, match=rf"{saved} is damaged or not a valid config .*restore it from a backup"):
        api.run([], [], d)
    with open(saved, "w") as f:
        f.write(good)
    with pytest.raises(UserError, match=r"gin config: .*nonexistent"):  # a bad --gin_param is not blamed on the file
        api.run([], ["train.nonexistent=1"], d)

    # plan.json: --mode=plan and a --mesh=auto resume.
    with open(os.path.join(d, "plan.json"), "w") as f:
        f.write('{"trained_with": {"mesh": "data:8", "colour": 1}}')
    with pytest.raises(UserError, match=rf"{d}/plan.json is damaged .*delete it and --mesh=auto plans again"):
        api.run(["gin/lm_tiny.gin"], params, d, mesh_spec="auto")
    with open(os.path.join(d, "plan.json"), "w") as f:
        f.write('{"mesh": ')
    with pytest.raises(UserError, match=rf"{d}/plan.json is damaged \(.*\): it holds a plan .*plan into another"):
        api.run(["gin/lm_tiny.gin"], params, d, mode="plan", mesh_spec="auto", plan_device="h100")
    assert not os.path.exists(os.path.join(d, "claim.json"))  # every refusal gave the folder back
