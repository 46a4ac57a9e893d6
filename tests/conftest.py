"""Shared test setup: 8 logical CPU devices, markers, and the runners tests share.

The pytest process runs on 8 logical CPU devices; tests that need another device count,
or several hosts, start subprocesses (`main_py`, `launch`). `make_run` builds a
Controller (and its Trainer) as main.py does, from configs.

Markers: `unit` marks tests that start no subprocess and train on no multi-device mesh
(`pytest -n 2 -m unit` runs them in under 3 minutes); the README's test command runs all.
"""

import gc
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's tfpod, whatever is installed

os.environ.setdefault("TFPOD_CPU_DEVICES", "8")
# Grappler's graph rewrites off (runtime.initialize): a third less compile time, which is
# most of a test's time; the same results. Subprocesses inherit it; the default-job smoke
# test (test_main.py) and the benchmarks run with them on, as users do.
os.environ.setdefault("TFPOD_GRAPH_OPTIMIZATIONS", "0")

import tfpod  # noqa: E402,F401  (selects tf_keras before TensorFlow loads)

gc.set_threshold(*tfpod.GC_THRESHOLDS)  # as main.py: TensorFlow's import walked less often


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: no subprocess and no multi-device training (pytest -m unit)")
    config.addinivalue_line("markers", "slurm: needs a real SLURM (bash .ci/slurm); left out unless -m selects it")
    config.addinivalue_line("markers", "applications: every tf_keras.applications family, sharded (an hour on 2 "
                                       "cores); left out unless -m selects it")
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist: files in the order collected (SLOWEST_FIRST)
    from tfpod import runtime

    runtime.initialize(cpu_devices=int(os.environ["TFPOD_CPU_DEVICES"]), device_type="CPU")


# The files that take longest (docs/benchmarks.md "Tests"), longest first. Under
# `-n 2 --dist loadfile` a worker takes the next file when it is almost done with its own,
# in collection order; started first, the long files leave short ones to even out the end
# (xdist's own order, by number of tests, left a long file running alone at the end).
SLOWEST_FIRST = ["test_pipeline", "test_context", "test_reliability", "test_attention_models", "test_ssd",
                 "test_run_folder", "test_async_checkpoint",
                 "test_convert", "test_keras", "test_keras3", "test_keras3_layers", "test_keras3_hosts", "test_dlrm", "test_multihost",
                 "test_input", "test_export", "test_lora", "test_bert",
                 "test_train", "test_eval", "test_plan", "test_resnet", "test_keras_layers", "test_presets",
                 "test_generation", "test_moe", "test_main", "test_transformer", "test_sharding", "test_text",
                 "test_pretrained_input"]


def pytest_collection_modifyitems(config, items):
    """`slurm` and `applications` tests run only when -m names them (bash .ci/slurm installs SLURM
    first); files in SLOWEST_FIRST order, then the rest as collected."""
    for marker in ("slurm", "applications"):
        if marker not in (config.option.markexpr or ""):
            kept = [item for item in items if marker not in item.keywords]
            if len(kept) != len(items):
                config.hook.pytest_deselected(items=[item for item in items if marker in item.keywords])
                items[:] = kept
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's own order stays


def main_command(*args) -> list[str]:
    """The command of `python main.py ARGS` (run it with cwd=ROOT; main_py runs it to the end)."""
    return [sys.executable, "main.py", *args]


def main_py(*args, timeout=600, env=None) -> subprocess.CompletedProcess:
    """`python main.py ARGS` in the checkout, its output captured; its console as a user's
    (TensorFlow's log level not the one tfpod set in this process)."""
    from tfpod import console

    return subprocess.run(main_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=console.child_env(env))


def run_module(module: str, *args, timeout=600, env=None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in the checkout (e.g. tfpod.convert), as main_py runs main.py."""
    from tfpod import console

    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=console.child_env(env))


def application_row(bench: str, *args, timeout: int) -> dict:
    """One model's row of an applications bench (`bench/BENCH --one=...`, in a process of its
    own), appended to the file TFPOD_APPLICATIONS_RESULTS names (the rows its docs table is made from)."""
    import json

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", bench), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    row = json.loads(lines[-1])
    results = os.environ.get("TFPOD_APPLICATIONS_RESULTS")
    if results:
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def launch_command(num_hosts: int, devices_per_host: int, *main_args) -> list[str]:
    """The command of `python -m tfpod.launch` running main.py with `main_args` on local hosts."""
    return [sys.executable, "-m", "tfpod.launch", f"--num_hosts={num_hosts}", f"--devices_per_host={devices_per_host}",
            "--", *main_command(*main_args)]


def make_run(task, model_config, train_config, optimizer_config, mesh, model_dir, preset=None, attention=None,
             actions=(), **sharding):
    """A Controller (with its Trainer) on `mesh` (a spec, with or without pipeline stages, or a
    Mesh) under `preset` (default: the task's), as main.py builds one; `attention`: its
    AttentionConfig (None: the defaults); `actions`: the run's own (tfpod.actions.Action);
    `sharding` are further ShardingConfig fields."""
    from tfpod import api, partitioning
    from tfpod.mesh import make_stage_meshes

    mesh = make_stage_meshes(mesh) if isinstance(mesh, str) else mesh
    config = partitioning.ShardingConfig(preset=preset, **sharding)
    placement = partitioning.Placement.from_config(config, task.default_preset, mesh, check=False,
                                                   attention=attention)
    return api.controller(task, model_config, train_config, optimizer_config, placement, str(model_dir),
                          schedule=config.pipeline_schedule, actions=actions)


def device_mesh(spec: str = "data:1,model:1"):
    """A mesh over the first devices of this process's 8 (as many as `spec` multiplies to),
    for `api.run(..., mesh=...)` and `make_run`: a test whose point is not sharding (input,
    run folders, goodput, errors) runs on one device, where building, compiling and each
    eager op cost a fraction of what 8 devices do; sharding itself is checked against such
    runs elsewhere (test_train, test_presets)."""
    import math

    from tensorflow.experimental import dtensor
    from tfpod.mesh import parse_mesh_spec

    count = math.prod(int(axis.split(":")[1]) for axis in spec.split(","))
    axes = parse_mesh_spec(spec, count)  # (tfpod's own checks of a spec)
    return dtensor.create_mesh(axes, devices=[f"CPU:{i}" for i in range(count)], device_type="CPU")


GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def assert_golden_layouts(report: str, name: str) -> None:
    """A run's layout report (its weights and optimizer state: layouts.txt) equals
    tests/golden/layouts_NAME.txt, so that a layout change shows as a diff. The tests that
    train each model on each preset check their own run's report (no model is built only
    for this). Regenerate with TFPOD_UPDATE_GOLDEN=1 after a deliberate change."""
    path = os.path.join(GOLDEN, f"layouts_{name}.txt")
    if os.environ.get("TFPOD_UPDATE_GOLDEN"):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(report)
    with open(path) as f:
        assert report == f.read(), f"{path}: the layouts changed (TFPOD_UPDATE_GOLDEN=1 rewrites it)"


@pytest.fixture(autouse=True, scope="module")
def fresh_keras_state():
    """Each test file starts with tf_keras's global state cleared, as a new process would: a
    pytest worker runs many files, and the state every model built before leaves behind made
    later Keras work slower (test_keras's checkpoint test: 7 s alone, 20 s after test_eval,
    95 s late in the suite; 10 s after test_eval with this)."""
    import tf_keras

    tf_keras.backend.clear_session()
    yield


@pytest.fixture
def no_keras3_distribution():
    """Keras 3 tests (`pytestmark = pytest.mark.usefixtures("no_keras3_distribution")`): each
    starts and ends with no keras.distribution set and Keras's state cleared."""
    import keras

    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    yield
    keras.distribution.set_distribution(None)
