"""The controller's actions (tfpod.actions), each on its own: what one call's Outcome makes
it do. The whole loop with real checkpoints, rollbacks and SIGTERM is tested in
test_reliability.py and test_controller.py."""

import json

import numpy as np
import pytest

from tfpod import actions, nonfinite
from tfpod.controller import TrainConfig
from tfpod.metrics_writer import MetricsWriter, Throughput
from tfpod.preemption import Preemption

pytestmark = pytest.mark.unit


def outcome(step, losses, total=10):
    losses = np.asarray(losses, np.float32)
    return actions.Outcome(step, losses, np.ones_like(losses), total)


def test_an_outcome_ends_the_run_at_the_last_step_or_a_stop():
    assert outcome(4, [1.0, 2.0]).end == 6 and not outcome(4, [1.0, 2.0]).last
    assert outcome(8, [1.0, 2.0]).last
    stopped = outcome(2, [1.0])
    stopped.stop = "target"
    assert stopped.last


def test_metrics_log_the_windows_mean_at_the_cadence_and_the_last_step(tmp_path):
    writer = MetricsWriter(str(tmp_path), True, 10, Throughput(8, 8 * 16, 1e6, 1e12))
    recorded = []
    metrics = actions.Metrics(writer, 4, lambda: 1e-3, lambda: None, lambda: recorded.append(1))
    metrics(outcome(0, [3.0, 5.0]))  # steps 1-2: no line yet
    assert metrics.last_loss is None and not (tmp_path / "metrics.jsonl").exists()
    metrics(outcome(2, [4.0, float("nan")]))  # steps 3-4: the line of 1-4, the NaN step left out
    assert metrics.last_loss == pytest.approx(4.0) and recorded == [1]
    metrics(outcome(4, [2.0] * 6))  # steps 5-10: the last step logs although 10 % 4 != 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["skipped_steps"]) for r in lines] == [(4, 4.0, 1), (10, 2.0, 0)]


def test_evaluation_runs_at_its_cadence_and_stops_the_run_at_the_target():
    calls = []

    def evaluate(step, extra):
        calls.append(step)
        return {"accuracy": 0.5 if step < 8 else 0.9, "train_seconds": extra["train_seconds"]}

    config = TrainConfig(steps=20, eval_every=4, target_metric="accuracy", target_value=0.8)
    evaluation = actions.Evaluation(evaluate, config, frozenset({"loss"}), 0.0)
    for step in (0, 2, 4):
        o = outcome(step, [1.0, 1.0], total=20)
        evaluation(o)
        assert o.stop is None
    o = outcome(6, [1.0, 1.0], total=20)
    evaluation(o)
    assert calls == [4, 8] and o.stop == "target" and o.last
    lower = actions.Evaluation(lambda step, extra: {"loss": 2.5}, TrainConfig(steps=4, eval_every=4, target_metric="loss",
                                                                              target_value=3.0), frozenset({"loss"}), 0.0)
    o = outcome(2, [1.0, 1.0], total=4)
    lower(o)
    assert o.stop == "target"  # a loss is reached from above


def test_a_preemption_any_host_agrees_on_stops_every_host_after_the_call():
    with Preemption(agree=lambda signaled: signaled) as alone:
        o = outcome(0, [1.0])
        actions.Preempt(alone)(o)
        assert o.stop is None  # nobody was signaled
    with Preemption(agree=lambda signaled: True) as told:  # another host received SIGTERM
        o = outcome(0, [1.0])
        actions.Preempt(told)(o)
        assert o.stop == "preempted" and o.last


def test_the_nonfinite_guard_counts_skipped_steps_in_a_row():
    """(Its stop and rollback read the run's checkpoints: test_reliability.py.)"""
    guard = nonfinite.NonfiniteGuard("skip", 2, checkpoints=None)
    act = actions.Nonfinite(guard)
    o = outcome(0, [1.0, float("nan"), float("inf")])
    act(o)
    assert o.rolled_back_to is None and guard.skipping == 2
    act(outcome(3, [1.0]))
    assert guard.skipping == 0


def test_the_run_record_is_written_once():
    written = []
    record = actions.RunRecord(lambda: written.append(1))
    for step in range(3):
        record(outcome(step, [1.0]))
    assert written == [1]
