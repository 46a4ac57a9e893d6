"""The hang watchdog (tfpod/watchdog.py): its limits, and what a hang writes and exits with.
A real hang on 2 hosts (one stopped with SIGSTOP) is in test_multihost.py."""

import time

import pytest

from tfpod import UserError, watchdog
from tfpod.controller import TrainConfig


@pytest.mark.unit
def test_limits_follow_the_median_call_after_the_first():
    w = watchdog.Watchdog(timeout_s=100.0, factor=10.0, min_s=2.0)
    try:
        assert w.call_limit(5) == 100.0  # the first call compiles
        w.after_call(0, 5, 40.0)  # (the first call: not in the median)
        assert w.call_limit(5) == 40.0  # the second: as long as the first (a hang right after a restart)
        for seconds in (1.0, 1.5, 0.5):  # 0.2, 0.3, 0.1 s a step: median 0.2
            w.after_call(5, 5, seconds)
        assert w.call_limit(5) == pytest.approx(10.0) and w.call_limit(1) == 2.0  # (at least min_s)
    finally:
        w.stop()


@pytest.mark.unit
def test_a_hang_writes_the_step_and_every_threads_stack_and_exits_124(tmp_path):
    exits = []
    with open(tmp_path / "log", "w+") as out:
        w = watchdog.Watchdog(timeout_s=0.3, factor=10.0, min_s=0.1, exit=exits.append, out=out)
        w.before_call(40, 10)
        deadline = time.time() + 10
        while not exits and time.time() < deadline:
            time.sleep(0.05)
        w.stop()
        out.seek(0)
        text = out.read()
    assert exits == [watchdog.EXIT_HUNG] == [124]
    assert text.startswith("error: hung: nothing finished in 0.3 s (training steps 41..50, at step 40): every "
                           "thread's stack follows; exiting with status 124")
    assert "Current thread" in text or "Thread 0x" in text
    assert "test_a_hang_writes_the_step" in text  # the main thread's stack, where it waited


@pytest.mark.unit
def test_an_unarmed_or_stopped_watchdog_never_fires_and_bad_limits_are_one_line():
    exits = []
    w = watchdog.Watchdog(timeout_s=0.2, factor=10.0, min_s=0.1, exit=exits.append)
    w.before_call(0, 1)
    w.stop()
    off = watchdog.Watchdog(timeout_s=0.0, factor=10.0, min_s=0.1, exit=exits.append)
    off.before_call(0, 1)
    time.sleep(0.5)
    assert exits == [] and off._thread is None
    with pytest.raises(UserError, match=r"train.hang_timeout_s=-1 \(>= 0; 0: off\)"):
        TrainConfig(hang_timeout_s=-1)
