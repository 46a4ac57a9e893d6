"""The preflight (tfpod.doctor): it runs clean here, on one host and on two, and names the
failure of each check when that check is broken for real (no mocks): a GPU asked of this
CPU machine, a model_dir under a regular file, input patterns that match nothing or match
a folder and a broken link, a mesh that does not fit, a checkpoint larger than the disk,
hosts that see different device counts, a host that dies before the collective; and
main.py's fast subset (one log line, or one `error:` line before anything is written)."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, main_py
from tfpod import console
from tfpod.launch import free_ports

TINY = ["--gin_file=gin/lm_tiny.gin", "--bandwidth_mb=1", "--write_mb=4"]
# A model whose predicted checkpoint (1.1 TiB, 103 billion parameters: built lazily, nothing
# allocated) no disk here holds: free space fails for real.
HUGE = ["--gin_param=gpt.embed_dim=65536", "--gin_param=gpt.mlp_dim=262144", "--gin_param=gpt.num_heads=64"]


def doctor_command(*args) -> list[str]:
    return [sys.executable, "-m", "tfpod.doctor", *args]


def doctor(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(doctor_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=console.child_env(env))


def lines(text: str) -> dict[str, str]:
    """{check: its whole line} of the doctor's output (a host prefix dropped)."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"(?:\[host \d\] )?(ok  |FAIL|warn|skip) ([^:]+): ", line)
        if m:
            found[m.group(2)] = line
    return found


def host_env(host: int, ports: list[int], cpu_devices: int) -> dict:
    return console.child_env({**os.environ, "DTENSOR_CLIENT_ID": str(host), "DTENSOR_NUM_CLIENTS": str(len(ports)),
                              "DTENSOR_JOB_NAME": "worker", "TFPOD_CPU_DEVICES": str(cpu_devices),
                              "DTENSOR_JOBS": ",".join(f"localhost:{p}" for p in ports)})


def test_doctor_runs_clean_on_one_host(tmp_path):
    proc = doctor(*TINY, "--cpu_devices=8", "--mesh=data:4,model:2", f"--model_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    found = lines(proc.stdout)
    assert set(found) >= {"config", "tensorflow", "cpu", "gpu", "devices", "mesh", "collective", "bandwidth",
                          "model_dir", "free space", "input lm_data.train_files"}, proc.stdout
    assert all(line.startswith("ok   ") for line in proc.stdout.splitlines()), proc.stdout
    assert "8 CPU device(s) on this host" in found["devices"]
    assert "exact" in found["collective"] and "GB/s" in found["bandwidth"]
    assert re.search(r"holds 4 checkpoints of 7\.63 MiB \(667,136 parameters", found["free space"]), found
    assert "a checkpoint write takes about" in found["free space"]
    assert proc.stderr.strip() == "", proc.stderr  # no TensorFlow start-up noise
    assert not (tmp_path / "run").exists()  # the probes leave nothing behind


def test_doctor_runs_clean_on_two_hosts_under_the_launcher(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tfpod.launch", "--num_hosts=2", "--devices_per_host=4", "--",
                           *doctor_command(*TINY, "--mesh=data:4,model:2", f"--model_dir={tmp_path}")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=console.child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for host in (0, 1):
        own = [line for line in proc.stdout.splitlines() if line.startswith(f"[host {host}] ")]
        assert all(line.startswith(f"[host {host}] ok   ") for line in own), own
        text = "\n".join(own)
        assert "4 CPU device(s) on this host; every host of 2 the same (8 in all)" in text
        assert "all-reduce of known values over 8 devices of 2 host(s): exact" in text
        assert f"[host {host}] ok   hosts: all 2 hosts passed every check" in text


def test_each_local_fault_is_named_with_its_fix(tmp_path):
    """One run, broken five ways: GPU asked of this CPU-only machine, model_dir under a
    regular file (root writes through chmod), a training pattern matching nothing, an eval
    pattern matching a folder and a broken link, an unreadable vocabulary."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some text\n")
    (data / "b.txt").mkdir()  # a folder named like a file
    os.symlink(tmp_path / "gone", data / "c.txt")  # a broken link
    (tmp_path / "file").write_text("x")
    proc = doctor(*TINY, "--device_type=GPU", f"--model_dir={tmp_path / 'file' / 'run'}",
                  f"--gin_param=lm_data.train_files='{tmp_path}/missing/*.txt'",
                  f"--gin_param=lm_data.eval_files='{data}/*.txt'", f"--gin_param=lm_data.vocab_path='{data}/c.txt'")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    found = lines(proc.stdout)
    assert found["gpu"].startswith("FAIL gpu: --device_type=GPU asked, but ") and "--device_type=CPU" in found["gpu"]
    assert found["devices" if "devices" in found else "mesh"].startswith("skip")
    assert found["model_dir"].startswith(f"FAIL model_dir: --model_dir={tmp_path / 'file' / 'run'} cannot be written "
                                         "(Not a directory); pass a folder")
    assert found["input lm_data.train_files"].startswith(f"FAIL input lm_data.train_files: input pattern "
                                                         f"'{tmp_path}/missing/*.txt' matches no file")
    evals = found["input lm_data.eval_files"]
    assert evals.startswith("FAIL input lm_data.eval_files: 2 of this host's 3 input file(s) cannot be read")
    assert f"{data}/b.txt: a folder, not a file" in evals and f"{data}/c.txt: " in evals
    assert found["input lm_data.vocab_path"].startswith(f"FAIL input lm_data.vocab_path: {data}/c.txt cannot be read")
    assert "Traceback" not in proc.stderr


def test_a_mesh_that_does_not_fit_and_a_checkpoint_the_disk_cannot_hold(tmp_path):
    proc = doctor(*TINY, *HUGE, "--cpu_devices=8", "--mesh=data:3", f"--model_dir={tmp_path}")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    found = lines(proc.stdout)
    assert found["mesh"] == ("FAIL mesh: --mesh='data:3' has 3 devices but the job has 8: make the sizes multiply to 8 "
                             "(or use -1 on one axis)")
    assert found["collective"].startswith("ok")  # the devices are fine
    space = found["free space"]
    assert re.match(r"FAIL free space: [\d.]+ [GTM]iB free under .*, but 4 checkpoints of 1\.13 TiB "
                    r"\(103,219,462,144 parameters; train\.keep_checkpoints=3 kept \+ 1 being written\) need "
                    r"4\.51 TiB; free space there, pass a --model_dir on a larger disk", space), space
    assert found["model_dir"].startswith("ok")


def test_hosts_that_see_different_device_counts_fail_on_every_host():
    ports = free_ports(2)
    procs = [subprocess.Popen(doctor_command(*TINY), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=host_env(h, ports, 4 + 2 * h)) for h in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for h, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 1, out + err[-3000:]
        found = lines(out)
        assert found["devices"] == (f"[host {h}] FAIL devices: {4 + 2 * h} CPU device(s) on this host, but the hosts see "
                                    "different counts (host 0: 4, host 1: 6); give every host the same devices: the "
                                    "same --cpu_devices (or $TFPOD_CPU_DEVICES), the same accelerators visible "
                                    "(CUDA_VISIBLE_DEVICES)")
        assert found["collective"].startswith(f"[host {h}] skip")
        assert found["hosts"] == (f"[host {h}] FAIL hosts: failed checks on host 0 (1), host 1 (1) of 2; fix what "
                                  "each host's FAIL lines name, then run the doctor again")


def test_a_host_that_dies_before_the_collective_fails_it_on_the_other():
    ports = free_ports(2)
    procs = [subprocess.Popen(doctor_command(*TINY), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=host_env(h, ports, 4)) for h in (0, 1)]
    # Host 1 dies once both hosts have seen the devices (their counts are exchanged: killed
    # before host 0 has its count, host 0 may be ended by TensorFlow's coordination service
    # without a line), before the all-reduce, whose tracing takes host 0 longer than the kill.
    seen, first = [], []
    for proc, read in ((procs[1], seen), (procs[0], first)):
        for line in proc.stdout:
            read.append(line)
            if "devices:" in line:
                break
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait(timeout=60)
    rest, err = procs[0].communicate(timeout=300)
    out = "".join(first) + rest
    assert procs[0].returncode == 1, out + err[-3000:]
    found = lines(out)
    assert found["devices"].startswith("[host 0] ok"), seen
    assert found["collective"].startswith("[host 0] FAIL collective: an all-reduce over 8 devices of 2 host(s) "
                                          "failed (host 1: "), found["collective"]
    assert "and that none stopped" in found["collective"]
    assert found["hosts"].startswith("[host 0] skip")


@pytest.mark.unit
def test_the_collective_is_checked_exactly_on_real_sums():
    """A collective that returns wrong numbers cannot be made here on purpose: the check's
    logic runs on this process's real all-reduce (8 logical devices), and on the same sums
    with one element off by one."""
    from tfpod import mesh as meshlib, runtime
    from tfpod.doctor import checks

    info = runtime.info()
    results = checks.collective(info, 0)
    assert [r.line() for r in results] == ["ok   collective: all-reduce of known values over 8 devices of 1 host(s): "
                                           "exact"]
    sums, _ = checks._all_reduce(meshlib.make_mesh("devices:-1"), lambda g: np.array([checks.known_row(g)],
                                                                                      np.float32))
    assert len(sums) == 8 and sums[0].tolist() == [28 + 8 * i for i in range(8)]
    assert not checks.check_sums(sums, 8, 1).failed
    sums[5] = sums[5].copy()
    sums[5][3] += 1
    bad = checks.check_sums(sums, 8, 1)
    assert bad.line().startswith("FAIL collective: an all-reduce of known values over 8 devices gave "
                                 "[28.0, 36.0, 44.0, 53.0, 60.0, 68.0, 76.0, 84.0] on local device 5, not ")


def test_the_fast_preflight_logs_one_line_and_is_switched_off_by_a_flag(tmp_path):
    """--mode=eval of a folder without checkpoints: the preflight passes (one line), then
    eval stops on its own error; with --nopreflight the line is gone."""
    on = main_py("--gin_file=gin/lm_tiny.gin", "--gin_param=train.synthetic_data=True", "--cpu_devices=8",
                 "--mode=eval", f"--model_dir={tmp_path}")
    off = main_py("--gin_file=gin/lm_tiny.gin", "--gin_param=train.synthetic_data=True", "--cpu_devices=8",
                  "--mode=eval", f"--model_dir={tmp_path}", "--nopreflight")
    for proc in (on, off):
        assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith(
            "error: --mode=eval needs eval data"), proc.stderr[-3000:]
    preflight = [line for line in on.stderr.splitlines() if "preflight:" in line]
    assert len(preflight) == 1 and re.search(r"preflight: \d+ checks passed in \d+ ms, \d+ ms of it starting the runtime",
                                                    preflight[0]), on.stderr
    assert "preflight" not in off.stderr


def _small_mount(path) -> bool:
    """A 16 MiB tmpfs at `path` (root only), or False."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_the_fast_preflight_stops_a_run_before_anything_is_written(tmp_path):
    """A model_dir on a real 16 MiB tmpfs (as root; elsewhere the huge model on tmp_path):
    lm_tiny's 4 checkpoints of 7.63 MiB do not fit. And an input pattern that matches
    nothing: the one error line names the first failure and counts the other."""
    model_dir = tmp_path / "small"
    mounted = _small_mount(model_dir)
    try:
        start = time.time()
        proc = main_py("--gin_file=gin/lm_tiny.gin", "--cpu_devices=8", f"--model_dir={model_dir}",
                       f"--gin_param=lm_data.train_files='{tmp_path}/missing/*.txt'", *([] if mounted else HUGE))
        assert proc.returncode == 1, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        size = "7.63 MiB (667,136 parameters" if mounted else "1.13 TiB (103,219,462,144 parameters"
        assert re.match(rf"error: [\d.]+ [KMG]iB free under {model_dir}, but 4 checkpoints of {re.escape(size)}; "
                        r"train\.keep_checkpoints=3 kept \+ 1 being written\) need [\d.]+ [MT]iB; free space there, "
                        r"pass a --model_dir on a larger disk, or lower train\.keep_checkpoints \(and 1 more: "
                        r"python -m tfpod\.doctor lists them\)$", last), last
        assert "Traceback" not in proc.stderr
        assert os.listdir(model_dir) == []  # nothing written
        assert time.time() - start < 120
    finally:
        if mounted:
            subprocess.run(["umount", str(model_dir)], check=True)


def test_the_write_probe_removes_its_folders_but_the_preflight_keeps_them(tmp_path):
    """The doctor leaves nothing; the preflight keeps the folder it made (the run makes it
    anyway): with several hosts, one host's removal once pulled it from under another host's
    write check ("cannot be written (No such file or directory)", seen in CI)."""
    from tfpod.doctor import storage

    storage.probe_write(str(tmp_path / "a" / "b"), 1, host_id=0)
    assert os.listdir(tmp_path) == []
    storage.probe_write(str(tmp_path / "a" / "b"), 1, host_id=0, keep_folders=True)
    assert os.listdir(tmp_path / "a" / "b") == []  # the scratch file is gone, the folders stay
    created = storage.missing_folders(str(tmp_path / "c" / "d"))
    assert created == [str(tmp_path / "c" / "d"), str(tmp_path / "c")]  # deepest first
    storage.probe_write(str(tmp_path / "c" / "d"), 1, host_id=0, keep_folders=True)
    (tmp_path / "c" / "kept").write_text("another host's")
    storage.remove_empty(created)  # a failed preflight's: its folders go, one filled meanwhile stays
    assert sorted(os.listdir(tmp_path)) == ["a", "c"] and os.listdir(tmp_path / "c") == ["kept"]
