"""A real SLURM (Debian's slurm-wlm: munged, slurmctld, slurmd on this machine) launches lm_tiny
as two tasks with `srun`; tfpod derives the hosts from SLURM's variables (tfpod.cluster).

Behind the `slurm` marker (the default run leaves it out): `bash .ci/slurm` installs the
packages and runs `python -m pytest -m slurm tests`.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from conftest import ROOT
from test_multihost import SMALL, host_pids, logged_losses, losses

from tfpod import api

pytestmark = pytest.mark.slurm

CONF = """ClusterName=tfpod
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-machine SLURM: munged (if none runs), slurmctld and slurmd with a generated slurm.conf."""
    for tool in ("munged", "slurmctld", "slurmd", "srun", "sinfo"):
        assert shutil.which(tool) or os.path.exists(f"/usr/sbin/{tool}"), f"{tool} is not installed: bash .ci/slurm"
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(host=socket.gethostname(), d=d, cpus=os.cpu_count()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    if subprocess.run(["munge", "-n"], capture_output=True).returncode:
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    daemons = [subprocess.Popen([f"/usr/sbin/{name}", "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for name in ("slurmctld", "slurmd")]
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            if out.strip() == "idle":
                break
            time.sleep(1)
        assert out.strip() == "idle", f"SLURM did not come up: sinfo says {out!r}; see {d}/slurmctld.log"
        yield env
    finally:
        for p in daemons:
            p.terminate()
            p.wait(timeout=30)


def test_srun_two_tasks_give_one_processes_losses(slurm, tmp_path):
    params = SMALL + ["train.steps=4", "train.synthetic_data=True"]
    cmd = ["srun", "-N1", "-n2", "--overcommit", "--kill-on-bad-exit=1", "python", "main.py",
           "--gin_file=gin/lm_tiny.gin", "--cpu_devices=4", "--mesh=data:4,model:2", f"--model_dir={tmp_path / 'slurm'}"]
    cmd += [f"--gin_param={p}" for p in params]
    env = {k: v for k, v in slurm.items() if not k.startswith("DTENSOR_")}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout + out.stderr
    host = socket.gethostname()
    assert f"slurm: host 0 of 2; hosts {host}:8476, {host}:8477" in text
    assert f"slurm: host 1 of 2; hosts {host}:8476, {host}:8477" in text
    api.run(["gin/lm_tiny.gin"], params, str(tmp_path / "one"), mode="train", mesh_spec="data:4,model:2")
    np.testing.assert_allclose(losses(tmp_path / "slurm"), losses(tmp_path / "one"), rtol=1e-5)
    assert len(losses(tmp_path / "slurm")) == 4  # host 0 alone writes metrics
    assert json.loads(open(tmp_path / "slurm" / "metrics.jsonl").readline())["step"] == 1


def test_a_killed_task_is_restarted_in_the_allocation_and_the_run_ends_as_an_uninterrupted_one(slurm, tmp_path):
    """examples/slurm/restart.sh around the srun step (as examples/slurm/train.sbatch runs it):
    task 1 of 2 killed with SIGKILL past a checkpoint ends the step (--kill-on-bad-exit); the
    script starts it again, it resumes from the newest complete checkpoint, and the run ends
    with one process's losses for every step; goodput counts the restart."""
    params = SMALL + ["train.steps=20", "train.synthetic_data=True", "train.steps_per_loop=1",
                      "train.checkpoint_every=2"]
    d = tmp_path / "slurm"
    cmd = ["bash", "examples/slurm/restart.sh", "srun", "-N1", "-n2", "--overcommit", "--kill-on-bad-exit=1",
           "python", "main.py", "--gin_file=gin/lm_tiny.gin", "--cpu_devices=4", "--mesh=data:4,model:2",
           f"--model_dir={d}"] + [f"--gin_param={p}" for p in params]
    env = {k: v for k, v in slurm.items() if not k.startswith("DTENSOR_")}
    env.update(TFPOD_MAX_RESTARTS="1", TFPOD_RESTART_BACKOFF_S="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not os.path.exists(d / "checkpoints" / "ckpt-4.index"):
        time.sleep(0.1)
    tasks = {rank: pid for pid, rank in host_pids(d, "SLURM_PROCID").items()}
    assert sorted(tasks) == [0, 1], "the run ended before a task could be killed"
    os.kill(tasks[1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, (stdout + stderr)[-3000:]
    assert "starting it again in 1 s, from the newest complete checkpoint (restart 1 of TFPOD_MAX_RESTARTS=1)" in stderr
    assert [launch["restart"] for launch in json.load(open(d / "goodput.json"))["launches"]] == [0, 1]
    api.run(["gin/lm_tiny.gin"], params, str(tmp_path / "one"), mode="train", mesh_spec="data:4,model:2")
    resumed, reference = logged_losses(d), logged_losses(tmp_path / "one")
    assert sorted(resumed) == sorted(reference) == list(range(1, 21))
    np.testing.assert_allclose([resumed[s] for s in range(1, 21)], [reference[s] for s in range(1, 21)], rtol=1e-5)
