"""Multi-host runs: 2 hosts x 4 logical CPU devices as real local processes via tfpod.launch."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import device_mesh, launch_command, main_command, make_run
from tfpod.api import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["gpt.num_layers=1", "gpt.embed_dim=64", "gpt.mlp_dim=128", "train.global_batch_size=16",
         "train.steps_per_loop=2", "train.log_every=1", "optimizer.decay_steps=8", "optimizer.warmup_steps=0"]
PIPELINE = ["gpt.num_layers=2", "train.microbatches=2", "sharding.pipeline_schedule='1f1b'"]  # 1 block per stage
SYNTHETIC = SMALL + ["train.synthetic_data=True", "train.steps_per_loop=1", "train.checkpoint_every=1"]


def main_args(model_dir, steps, extra=(), mesh="data:4,model:2"):
    args = ["--gin_file=gin/lm_tiny.gin", f"--mesh={mesh}", f"--model_dir={model_dir}"]
    return args + [f"--gin_param={p}" for p in SMALL + [f"train.steps={steps}", *extra]]


def errors(proc):
    """The lines that say what went wrong, for assertion messages."""
    lines = (proc.stdout + proc.stderr).splitlines()
    return "\n".join([l for l in lines if "error" in l.lower() or "Error" in l][-8:] + lines[-5:])


def losses(model_dir):
    """The train records' losses in metrics.jsonl."""
    records = [json.loads(l) for l in open(os.path.join(model_dir, "metrics.jsonl"))]
    return [r["loss"] for r in records if r["kind"] == "train"]


def logged_losses(model_dir) -> dict[int, float]:
    """Each logged step's loss (a step replayed after a kill keeps its last value)."""
    out = {}
    for line in open(os.path.join(model_dir, "metrics.jsonl")):
        record = json.loads(line)
        if record.get("kind") == "train":
            out[record["step"]] = record["loss"]
    return out


def host_pids(model_dir, variable: str = "DTENSOR_CLIENT_ID") -> dict[int, int]:
    """The processes of the hosts training in model_dir: pid -> their host id (the environment
    `variable`: DTensor's client id, or SLURM_PROCID under srun)."""
    pids = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        client = [v.split(b"=", 1)[1] for v in env if v.startswith(f"{variable}=".encode())]
        if client and str(model_dir).encode() in cmdline:
            pids[int(pid)] = int(client[0])
    return pids


def test_two_hosts_train_one_processs_losses_and_write_one_background_checkpoint_to_resume_from(tmp_path):
    """2 local hosts x 4 devices, data:2,model:4 across them under the 2d preset (weights split
    over both axes, so each host owns shards), checkpoints written in the background: every
    host logs its progress, only host 0 writes metrics and summaries; each host writes its own
    part of a checkpoint and host 0 merges it; the checkpoint restores in one process on
    another mesh and preset with identical values; relaunched from it as a pipeline
    (stage:2,data:2,model:2, each host holding part of every stage, 2 microbatches, 1f1b), the
    run repeats the losses of one device (one of this process's) step by step."""
    from test_reliability import assert_restores_identically
    from tfpod import checkpoint
    from tfpod.config import build_config, build_task_configs, parse_config

    d = tmp_path / "run"
    params = SYNTHETIC + ["gpt.num_layers=2", "train.async_checkpoint=True", "train.checkpoint_every=2"]
    args = lambda steps, mesh, extra: ["--gin_file=gin/lm_tiny.gin", f"--mesh={mesh}", f"--model_dir={d}",
                                       *[f"--gin_param={p}" for p in params + [f"train.steps={steps}", *extra]]]
    out = subprocess.run(launch_command(2, 4, *args(4, "data:2,model:4", ["sharding.preset='2d'"])), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, errors(out)
    assert "[host 0]" in out.stdout and "[host 1]" in out.stdout and "host 1 of 2" in out.stdout
    assert re.search(r"\[host 1\] .*step 4/4 \| loss", out.stdout)  # every host logs its progress
    assert len(losses(d)) == 4  # one metrics.jsonl line per step: only host 0 writes metrics, config, summaries
    assert len(os.listdir(d / "train")) == 1
    assert "written in the background" in out.stdout + out.stderr
    copied = [line for line in out.stdout.splitlines() if "copied off the devices" in line]
    assert len(copied) == 4 and not [line for line in copied if "this host's 0 B" in line]  # 2 saves x 2 hosts
    assert checkpoint.complete_steps(str(d / "checkpoints")) == [2, 4]
    assert len(list((d / "checkpoints").glob("ckpt-4.data-*-of-00002"))) == 2  # each host's part
    assert not list((d / "checkpoints").glob("*_temp*"))

    # The 2-host checkpoint restores in one process, on another mesh and preset, with identical values.
    parse_config(["gin/lm_tiny.gin"], SYNTHETIC + ["gpt.num_layers=2", "train.steps=6"])
    task, model_config, _ = build_task_configs()
    one_host = make_run(task, model_config, build_config("train"), build_config("optimizer"), "data:8",
                        tmp_path / "restored", preset="data")
    assert one_host.checkpoints.restore(str(d / "checkpoints" / "ckpt-4")) == 4
    assert_restores_identically(one_host, str(d / "checkpoints" / "ckpt-4"))

    again = subprocess.run(launch_command(2, 4, *args(6, "stage:2,data:2,model:2", PIPELINE[1:])), cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, errors(again)
    assert f"resumed from {d}/checkpoints/ckpt-4" in again.stdout + again.stderr
    assert "stage:2,data:2,model:2" in again.stdout and "2 pipeline stages (1f1b)" in again.stdout
    run(["gin/lm_tiny.gin"], SYNTHETIC + ["gpt.num_layers=2", "train.steps=6"], str(tmp_path / "one"),
        mesh=device_mesh())
    reference, resumed = logged_losses(tmp_path / "one"), logged_losses(d)
    assert sorted(resumed) == list(range(1, 7))
    np.testing.assert_allclose([resumed[s] for s in range(1, 7)], [reference[s] for s in range(1, 7)], rtol=1e-5)


def test_pipelined_hosts_read_disjoint_files_a_killed_host_stops_the_job_and_the_rerun_resumes_exactly(tmp_path):
    """2 hosts x 4 devices on stage:2,data:2,model:2 (each host holds part of every stage),
    reading the lm_tiny train files: host 1 killed with -9 mid-run stops the job (the launcher
    kills host 0, which waits on it, here stopped). The relaunch takes the dead job's claim on the folder over,
    moves its damaged newest checkpoint aside, resumes from the one before with the input's
    position, and repeats the killed run's losses step by step; a preemption notice sent twice
    to the launcher reaches both hosts, which save the same step and exit 0."""
    d = tmp_path / "run"
    cmd = lambda steps: launch_command(2, 4, *main_args(d, steps, [*PIPELINE, "train.checkpoint_every=2"], mesh="stage:2,data:2,model:2"))
    proc = subprocess.Popen(cmd(400), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not os.path.exists(d / "checkpoints" / "ckpt-4.index"):
        time.sleep(0.2)
    assert os.path.exists(d / "checkpoints" / "ckpt-4.index"), "no checkpoint in time"
    hosts = {client: pid for pid, client in host_pids(d).items()}
    assert sorted(hosts) == [0, 1]
    # Host 0 held still first, so that the launcher's SIGKILL, not the lost-host error (which
    # gives the claim back), ends it: the dead job's claim stays, as after a machine failure.
    os.kill(hosts[0], signal.SIGSTOP)
    killed_at = time.time()
    os.kill(hosts[1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    assert time.time() - killed_at < 60
    assert proc.returncode != 0
    assert "error: host 1 was killed by SIGKILL" in stderr.strip().splitlines()[-1]
    assert "stage:2,data:2,model:2" in stdout and "2 pipeline stages (1f1b)" in stdout
    files = {h: set(re.search(rf"\[host {h}\] .*input: host {h} of 2 reads \d+ file\(s\): (\S+)", stdout).group(1).split(","))
             for h in (0, 1)}
    assert files[0] and files[1] and not files[0] & files[1]
    assert len(files[0] | files[1]) == 32  # together the hosts read every train shard

    killed = logged_losses(d)
    holder = json.load(open(d / "claim.json"))  # the killed job's claim on the folder stays
    newest = max(int(f.name[5:-6]) for f in (d / "checkpoints").glob("ckpt-*.index"))
    saved = newest - 2
    assert 4 <= newest and max(killed) >= newest
    # ... and its newest checkpoint damaged (a shard of another write beside its own): moved aside.
    shards = list((d / "checkpoints").glob(f"ckpt-{newest}.data-*"))
    (d / "checkpoints" / f"ckpt-{newest}.data-00000-of-{len(shards) + 1:05d}").write_bytes(shards[0].read_bytes())

    # The rerun; a preemption notice sent twice (cluster managers repeat it) to the launcher reaches
    # both hosts (TensorFlow's runtime had taken SIGTERM over in C++ and ignored it).
    logged = len(_logged_steps(d))
    rerun = subprocess.Popen(cmd(newest + 400), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and rerun.poll() is None and max(_logged_steps(d)[logged:], default=0) < newest + 2:
        time.sleep(0.2)
    rerun.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    rerun.send_signal(signal.SIGTERM)
    stdout, stderr = rerun.communicate(timeout=180)
    assert rerun.returncode == 0, stderr[-3000:]
    out = stdout + stderr
    assert "was claimed by a run that is gone" in out and f"process {holder['pid']}" in out
    assert f"ckpt-{newest} is damaged" in out and (d / "checkpoints" / f"ckpt-{newest}.corrupt.0.index").exists()
    assert f"resumed from {d}/checkpoints/ckpt-{saved} at step {saved}" in out and "input resumed" in stdout
    steps = {h: re.search(rf"\[host {h}\] .*preempted: saved \S+ at step (\d+)", stdout) for h in (0, 1)}
    assert steps[0] and steps[1], stdout[-3000:]
    assert steps[0].group(1) == steps[1].group(1) and newest + 2 <= int(steps[0].group(1)) < newest + 400
    assert not (d / "claim.json").exists()
    # The replayed steps (the killed run's, from the checkpoint before the damaged one) repeat its losses.
    resumed = logged_losses(d)
    replayed = [s for s in range(saved + 1, max(killed) + 1) if s in resumed]
    assert replayed[:2] == [saved + 1, saved + 2]
    np.testing.assert_allclose([resumed[s] for s in replayed], [killed[s] for s in replayed], rtol=1e-6)


def _logged_steps(model_dir):
    try:
        return [json.loads(l)["step"] for l in open(os.path.join(model_dir, "metrics.jsonl"))]
    except (OSError, ValueError):
        return []


def test_without_a_launcher_a_frozen_host_is_named_by_the_heartbeat(tmp_path):
    """On a cluster no launcher stops the others: a host that hangs (SIGSTOP, connection
    still open) stops sending heartbeats, and the coordination service ends the survivor."""
    from tfpod.launch import free_ports, host_env

    ports = free_ports(2)
    cmd = main_command(*main_args(tmp_path, 2000, ["train.synthetic_data=True", "train.log_every=2"]))
    logs = [open(tmp_path / f"host{h}.log", "w+") for h in range(2)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=host_env(h, 2, ports, 4), stdout=logs[h], stderr=subprocess.STDOUT)
             for h in range(2)]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and "step 4/2000" not in open(tmp_path / "host0.log").read():
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGSTOP)
        frozen_at = time.time()
        assert procs[0].wait(timeout=60) == 1
        assert time.time() - frozen_at < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
    # Our one line; the runtime's own gRPC teardown lines may print after it at exit.
    errors_ = [l for l in open(tmp_path / "host0.log").read().splitlines() if l.startswith("error: ")]
    assert errors_, open(tmp_path / "host0.log").read()[-2000:]
    assert errors_[-1].startswith("error: lost host 1 of 2 (") and "relaunch the same command on every host" in errors_[-1]


def test_two_hosts_train_resume_and_evaluate_llama_with_one_devices_numbers(tmp_path):
    """The Llama-family decoder (grouped-query attention: 2 key/value heads, replicated over
    model:4) on 2 local hosts x 4 devices, data:2,model:4 across them: 2 steps and a
    checkpoint, relaunched to resume to step 4 (each step's loss is one device's, run straight
    through), then evaluated on 2 hosts on a file of the default corpus's eval split (each host
    every other record): one device's evaluation of the same checkpoint gives the same metrics
    over the same rows. (`max_eval_examples` would take the first rows of each host's share.)"""
    params = ["train.synthetic_data=True", "train.global_batch_size=16", "train.steps_per_loop=2",
              "train.log_every=1", "train.checkpoint_every=2", "optimizer.warmup_steps=0",
              "optimizer.decay_steps=8", "llama.num_layers=1"]  # one schedule for both launches
    d = tmp_path / "two"
    launch = lambda *args: subprocess.run(
        launch_command(2, 4, "--gin_file=gin/llama_tiny.gin", "--mesh=data:2,model:4", f"--model_dir={d}", *args),
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    for steps in (2, 4):
        out = launch(*[f"--gin_param={p}" for p in params + [f"train.steps={steps}"]])
        assert out.returncode == 0, errors(out)
    assert "host 1 of 2" in out.stdout and "llama variables on mesh data:2,model:4" in out.stdout
    assert "trained steps 2..4" in out.stdout, out.stdout[-2000:]  # resumed from the checkpoint at 2
    run(["gin/llama_tiny.gin"], params + ["train.steps=4"], str(tmp_path / "one"), mesh=device_mesh())
    assert sorted(logged_losses(d)) == [1, 2, 3, 4]
    np.testing.assert_allclose([logged_losses(d)[s] for s in range(1, 5)],
                               [logged_losses(tmp_path / "one")[s] for s in range(1, 5)], rtol=2e-5)
    from tfpod.input import prepare

    first = sorted(tf.io.gfile.glob(prepare.split_paths(prepare.ensure(), "eval")))[0]  # one file, split by records
    evaluation = params[1:] + ["train.steps=4", f"lm_data.eval_files='{first}'"]
    out = launch("--mode=eval", *[f"--gin_param={p}" for p in evaluation])
    assert out.returncode == 0, errors(out)
    two = [json.loads(l) for l in open(d / "metrics.jsonl") if '"eval"' in l][-1]
    one = run(["gin/llama_tiny.gin"], evaluation, str(d), mode="eval", mesh=device_mesh())
    assert two["step"] == one["step"] == 4 and two["num_examples"] == one["num_examples"] > 0
    for key in ("loss", "perplexity", "token_accuracy"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), (key, two, one)


@pytest.mark.parametrize("gin_file,model", [("lm_tiny", "gpt"), ("bert_tiny", "bert"), ("llama_tiny", "llama")])
def test_two_hosts_train_lora_adapters_with_one_devices_losses(tmp_path, gin_file, model):
    """LoRA (rank 4 on attention and MLP; tfpod.lora) on the tiny GPT, BERT and Llama, 2 local
    hosts x 4 devices, data:2,model:4 (`tensor`) across them: the same losses as one device
    (relative 1e-4, as every preset's test: sums over shards round differently).
    GPT and BERT train on a fresh base (their checkpoints hold the whole model): its frozen
    kernels equal the one-device run's (both start from the same seed). Llama starts from a base
    checkpoint (train.init_from), so its checkpoints hold the adapters alone, and it is
    relaunched on 2 hosts from one: every host reads the base, then the adapters."""
    gin = [f"gin/{gin_file}.gin"]
    params = ["train.synthetic_data=True", "train.global_batch_size=16", "train.steps_per_loop=2",
              "train.log_every=1", "train.checkpoint_every=2", "optimizer.warmup_steps=0",
              f"{model}.num_layers=1", "lora.rank=4", "lora.targets=('attention', 'mlp')"]
    steps = [2, 4] if model == "llama" else [2]
    if model == "llama":
        run(gin, params[:-2] + ["train.steps=2"], str(tmp_path / "base"), mesh=device_mesh())
        params.append(f"train.init_from='{tmp_path / 'base'}'")
    d = tmp_path / "two"
    for n in steps:
        out = subprocess.run(launch_command(2, 4, f"--gin_file={gin[0]}", "--mesh=data:2,model:4", f"--model_dir={d}",
                                            *[f"--gin_param={p}" for p in params + [f"train.steps={n}"]]),
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, errors(out)
    assert "host 1 of 2" in out.stdout
    run(gin, params + [f"train.steps={steps[-1]}"], str(tmp_path / "one"), mesh=device_mesh())
    np.testing.assert_allclose([logged_losses(d)[s] for s in range(1, steps[-1] + 1)],
                               [logged_losses(tmp_path / "one")[s] for s in range(1, steps[-1] + 1)], rtol=1e-4)
    two, one = (str(p / "checkpoints" / f"ckpt-{steps[-1]}") for p in (d, tmp_path / "one"))
    keys = [key for key, _ in tf.train.list_variables(one)]
    if model == "llama":
        assert f"resumed from {d}/checkpoints/ckpt-2" in out.stdout + out.stderr
        assert not [k for k in keys if "/kernel/" in k]  # the base's weights are read from the base
    else:
        assert "lora.rank=4 without train.init_from" in out.stdout + out.stderr
        assert [k for k in keys if "/kernel/" in k]
    for key in keys:
        if "/kernel/" in key and "OPTIMIZER" not in key:  # frozen: as initialized, on any mesh
            np.testing.assert_array_equal(tf.train.load_variable(two, key), tf.train.load_variable(one, key))

def restartable_run(d, extra):
    """20 steps of the small GPT on 2 hosts (data:2,model:4) under tfpod.launch --max_restarts=1,
    started and left running once ckpt-4 is written: (the launcher, {host: pid})."""
    cmd = [sys.executable, "-m", "tfpod.launch", "--num_hosts=2", "--devices_per_host=4", "--max_restarts=1",
           "--restart_backoff_s=0.5", "--", *main_command(*main_args(d, 20, extra, mesh="data:2,model:4"))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not os.path.exists(d / "checkpoints" / "ckpt-4.index"):
        time.sleep(0.1)
    return proc, {client: pid for pid, client in host_pids(d).items()}


def assert_one_devices_losses(d, extra, one):
    """Every step of run `d` (20 steps, replayed ones by their last value) has one device's loss."""
    run(["gin/lm_tiny.gin"], SMALL + extra + ["train.steps=20"], str(one), mesh=device_mesh())
    reference, resumed = logged_losses(one), logged_losses(d)
    assert sorted(resumed) == list(range(1, 21))
    np.testing.assert_allclose([resumed[s] for s in range(1, 21)], [reference[s] for s in range(1, 21)], rtol=1e-5)


def test_the_launcher_restarts_every_host_after_one_is_killed_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    """tfpod.launch --max_restarts=1: host 1 of 2 killed with SIGKILL past a checkpoint; the
    launcher stops host 0, starts both again after its backoff (TFPOD_RESTART=1), they resume
    from the newest complete checkpoint, and the job exits 0 with the losses of one device's
    uninterrupted run; goodput counts the automatic restart."""
    d = tmp_path / "run"
    extra = ["train.synthetic_data=True", "train.steps_per_loop=1", "train.checkpoint_every=2"]
    proc, hosts = restartable_run(d, extra)
    assert sorted(hosts) == [0, 1], "the run ended before a host could be killed"
    os.kill(hosts[1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, (stdout + stderr)[-3000:]
    assert "launcher: host 1 was killed by SIGKILL: starting every host again in 0.5 s, from the newest complete " \
           "checkpoint (restart 1 of --max_restarts=1)" in stderr
    assert "resumed from" in stdout
    history = json.load(open(d / "goodput.json"))["launches"]
    assert [launch["restart"] for launch in history] == [0, 1]
    assert "(1 automatic restart(s))" in stdout
    assert_one_devices_losses(d, extra, tmp_path / "one")


def test_the_launcher_never_restarts_after_a_sigterm_and_stops_after_max_restarts(tmp_path):
    """Hosts that count their starts: one failing every start is started 1 + --max_restarts
    times, then the launcher exits with its code; a SIGTERM (preemption) to the launcher
    reaches every host and is not followed by a restart, even when a host then fails."""
    host = ("import os, signal, sys, time\n"
            f"open(os.path.join({str(tmp_path)!r}, 'starts'), 'a').write(os.environ['TFPOD_RESTART'] + '\\n')\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
            "if sys.argv[1] == 'fail' and os.environ['DTENSOR_CLIENT_ID'] == '1': sys.exit(5)\n"
            "print('ready', flush=True); time.sleep(60)\n")
    launcher = lambda mode: [sys.executable, "-m", "tfpod.launch", "--num_hosts=2", "--max_restarts=2",
                             "--restart_backoff_s=0.1", "--", sys.executable, "-c", host, mode]
    starts = lambda: open(tmp_path / "starts").read().split()
    out = subprocess.run(launcher("fail"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 5
    assert sorted(starts()) == ["0", "0", "1", "1", "2", "2"]
    assert out.stderr.strip().splitlines()[-1].startswith("error: host 1 exited with status 5 after 2 automatic "
                                                          "restart(s)")
    assert re.findall(r"again in ([\d.]+) s", out.stderr) == ["0.1", "0.2"]  # doubled at each restart in a row
    # a start that ran --restart_reset_s before failing was healthy: the next wait is the first again
    os.remove(tmp_path / "starts")
    out = subprocess.run(launcher("fail")[:5] + ["--restart_reset_s=0"] + launcher("fail")[5:], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 5 and re.findall(r"again in ([\d.]+) s", out.stderr) == ["0.1", "0.1"]
    os.remove(tmp_path / "starts")
    proc = subprocess.Popen(launcher("wait"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and len(starts() if os.path.exists(tmp_path / "starts") else []) < 2:
        time.sleep(0.05)
    time.sleep(0.5)  # (the hosts' SIGTERM handlers set)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3 and starts() == ["0", "0"] and "starting every host again" not in stderr


def test_a_stopped_host_is_caught_by_the_hang_watchdog_and_the_launcher_restarts_the_run(tmp_path):
    """Host 1 of 2 stopped with SIGSTOP mid-training: host 0 waits for it in a collective until
    its hang watchdog (tfpod.watchdog; train.hang_min_s=5 here, under the coordination
    service's own timeout) writes every thread's stack and exits 124; tfpod.launch
    --max_restarts=1 stops host 1 and starts both again, and the run ends with one device's
    losses for every step."""
    d = tmp_path / "run"
    extra = ["train.synthetic_data=True", "train.steps_per_loop=1", "train.checkpoint_every=2",
             "train.hang_min_s=5", "train.hang_factor=10"]
    proc, hosts = restartable_run(d, extra)
    assert sorted(hosts) == [0, 1], "the run ended before a host could be stopped"
    os.kill(hosts[1], signal.SIGSTOP)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, (stdout + stderr)[-3000:]
    assert re.search(r"\[host 0\] error: hung: nothing finished in \d+\.\d s \(training steps \d+\.\.\d+, at step \d+\)",
                     stdout), stdout[-3000:]
    assert "[host 0] Thread 0x" in stdout or "[host 0] Current thread" in stdout  # its stacks
    assert "launcher: host 0 exited with status 124: starting every host again" in stderr
    assert_one_devices_losses(d, extra, tmp_path / "one")
