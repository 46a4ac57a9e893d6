"""The controller's actions (tfpod.actions), each on its own: what one call's Outcome makes
it do. The whole loop with real checkpoints, rollbacks and SIGTERM is tested in
test_reliability.py and test_controller.py."""

import json
import os

import numpy as np
import pytest

from conftest import device_mesh
from tfpod import UserError, actions, nonfinite
from tfpod.api import run
from tfpod.controller import Controller, TrainConfig
from tfpod.metrics_writer import MetricsWriter, Throughput
from tfpod.preemption import Preemption


def outcome(step, losses, total=10):
    losses = np.asarray(losses, np.float32)
    return actions.Outcome(step, losses, np.ones_like(losses), total)


@pytest.mark.unit
def test_an_outcome_ends_the_run_at_the_last_step_or_a_stop():
    assert outcome(4, [1.0, 2.0]).end == 6 and not outcome(4, [1.0, 2.0]).last
    assert outcome(8, [1.0, 2.0]).last
    stopped = outcome(2, [1.0])
    stopped.stop = "target"
    assert stopped.last


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_a_preemption_any_host_agrees_on_stops_every_host_after_the_call():
    with Preemption(agree=lambda signaled: signaled) as alone:
        o = outcome(0, [1.0])
        actions.Preempt(alone)(o)
        assert o.stop is None  # nobody was signaled
    with Preemption(agree=lambda signaled: True) as told:  # another host received SIGTERM
        o = outcome(0, [1.0])
        actions.Preempt(told)(o)
        assert o.stop == "preempted" and o.last


@pytest.mark.unit
def test_the_nonfinite_guard_counts_skipped_steps_in_a_row():
    """(Its stop and rollback read the run's checkpoints: test_reliability.py.)"""
    guard = nonfinite.NonfiniteGuard("skip", 2, checkpoints=None)
    act = actions.Nonfinite(guard)
    o = outcome(0, [1.0, float("nan"), float("inf")])
    act(o)
    assert o.rolled_back_to is None and guard.skipping == 2
    act(outcome(3, [1.0]))
    assert guard.skipping == 0


@pytest.mark.unit
def test_the_run_record_is_written_once():
    written = []
    record = actions.RunRecord(lambda: written.append(1))
    for step in range(3):
        record(outcome(step, [1.0]))
    assert written == [1]


@pytest.mark.unit
def test_a_periodic_condition_says_when_it_is_due_and_when_next():
    every = actions.Every(4)
    assert [s for s in range(1, 10) if every.due(s)] == [4, 8]
    assert (every.next(0), every.next(3), every.next(4)) == (4, 4, 8)
    each_call = actions.Every()  # after every call, wherever it ends: it cuts no call
    assert each_call.due(7) and each_call.next(7) is None
    for bad in (0, -2, 1.5, True):
        with pytest.raises(UserError, match="must be a whole number of steps, at least 1"):
            actions.Every(bad)


class Steps(actions.Action):
    """A run's own action, as a user writes one: the steps it ran at."""

    def __init__(self, every=None):
        super().__init__(every)
        self.ran = []

    def run(self, outcome):
        self.ran.append(outcome.end)


class Enough(actions.Action):
    def run(self, outcome):
        outcome.stop = "enough"


def test_a_runs_own_actions_run_at_their_steps_the_calls_end_there_and_a_stop_is_saved(tmp_path):
    """tfpod.run(..., actions=[...]) on one device (steps_per_loop 4, log_every 4): an action
    every 3 steps runs at 3 and 6, and the compiled loop's calls end there (an action after
    every call sees 3, 4, 6); one that stops the run at 6 ends it there with a checkpoint of
    step 6. Anything else handed as an action, or actions in a mode that trains nothing, is
    one line."""
    params = ["gpt.num_layers=1", "gpt.embed_dim=32", "gpt.num_heads=2", "gpt.mlp_dim=64", "gpt.seq_len=16",
              "gpt.vocab_size=128", "lm_data.vocab_size=128", "train.synthetic_data=True", "train.steps=8", "train.steps_per_loop=4",
              "train.log_every=4", "train.checkpoint_every=100", "train.global_batch_size=2"]
    every3, each_call = Steps(3), Steps()
    out = run(["gin/lm_tiny.gin"], params, str(tmp_path), mesh=device_mesh("data:1"),
              actions=[every3, each_call, Enough(6)])
    assert every3.ran == [3, 6] and each_call.ran == [3, 4, 6]
    assert out["step"] == 6 and len(out["losses"]) == 6 and not out["preempted"]
    assert os.path.exists(tmp_path / "checkpoints" / "ckpt-6.index")
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [4]
    with pytest.raises(UserError, match="is a function, not a tfpod.actions.Action: subclass it"):
        Controller(None, TrainConfig(), str(tmp_path), actions=[lambda outcome: None])
    with pytest.raises(UserError, match="--mode=eval trains nothing"):
        run(["gin/lm_tiny.gin"], params, str(tmp_path), mode="eval", actions=[Steps()])
