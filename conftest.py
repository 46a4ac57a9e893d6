"""Test setup: the pytest process runs on 8 logical CPU devices (tests/README in README.md).

Tests that need another device count, or several hosts, start subprocesses.
"""

import os

os.environ.setdefault("TFPOD_CPU_DEVICES", "8")
# Grappler's graph rewrites off (runtime.initialize): a third less compile time, which is
# most of a test's time; the same results. Subprocesses inherit it; the default-job smoke
# test (test_main.py) and the benchmarks run with them on, as users do.
os.environ.setdefault("TFPOD_GRAPH_OPTIMIZATIONS", "0")

import tfpod  # noqa: E402,F401  (selects tf_keras before TensorFlow loads)


def pytest_configure(config):
    from tfpod import runtime

    runtime.initialize(cpu_devices=int(os.environ["TFPOD_CPU_DEVICES"]), device_type="CPU")
