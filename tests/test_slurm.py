"""A real SLURM (Debian's slurm-wlm: munged, slurmctld, slurmd on this machine) launches lm_tiny
as two tasks with `srun`; tfpod derives the hosts from SLURM's variables (tfpod.cluster).

Behind the `slurm` marker (the default run leaves it out): `bash .ci/slurm` installs the
packages and runs `python -m pytest -m slurm tests`.
"""

import json
import os
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

from conftest import ROOT
from test_multihost import SMALL, losses

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
