"""What a run reports: its console lines, metrics.jsonl and TensorBoard summaries.

Every host logs its own progress lines; only host 0 (`chief`) writes metrics.jsonl
(one JSON object per line: `kind` "train" or "eval") and the TensorBoard events under
model_dir/train and model_dir/eval. The TensorBoard writer is made at the first
record, so a run that stops before training writes none.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import time
from typing import Mapping

import numpy as np
import tensorflow as tf

from tfpod import flops

log = logging.getLogger("tfpod")

TRAIN_SCALARS = ("loss", "tokens_per_sec", "examples_per_sec", "mfu", "learning_rate", "grad_norm")


@dataclasses.dataclass
class Throughput:
    """What turns steps per second into the reported rates.

    Attributes:
      examples_per_step: the global batch.
      tokens_per_step: examples x tokens per example (the global batch when the task
        counts examples).
      flops_per_step: model FLOPs of one step.
      peak_flops: the peak FLOP/s of the devices that run it (for MFU).
    """

    examples_per_step: int
    tokens_per_step: int
    flops_per_step: float
    peak_flops: float


class MetricsWriter:
    """Console lines, metrics.jsonl and TensorBoard of one run (see the module docstring)."""

    def __init__(self, model_dir: str, chief: bool, total_steps: int, throughput: Throughput):
        self.model_dir, self.chief, self.total_steps, self.rates = model_dir, chief, total_steps, throughput
        self._writers: dict[str, tf.summary.SummaryWriter] = {}
        self._grad_norm = float("nan")
        self.reset_window()

    def _append(self, record: dict) -> None:
        with open(os.path.join(self.model_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _summaries(self, folder: str, step: int, values: Mapping[str, float]) -> None:
        if folder not in self._writers:
            self._writers[folder] = tf.summary.create_file_writer(os.path.join(self.model_dir, folder))
        with self._writers[folder].as_default(step=step):
            for k, v in values.items():
                tf.summary.scalar(k, v)

    def add_steps(self, losses: np.ndarray, grad_norms: np.ndarray) -> None:
        """Counts the steps of one call of the compiled loop into the current log window."""
        finite = np.isfinite(losses) & np.isfinite(grad_norms)
        self._losses.extend(float(x) for x in losses[finite])
        self._skipped += int(len(losses) - finite.sum())
        self._steps += len(losses)
        self._grad_norm = float(grad_norms[-1])

    def reset_window(self) -> None:
        """Starts a new log window (after a log line, and after a rollback drops steps)."""
        self._losses, self._steps, self._skipped, self._started = [], 0, 0, time.time()

    def train(self, step: int, learning_rate: float, seconds_per_step: float | None) -> dict:
        """One progress line and record for the window's steps, up to `step`; starts a new window.

        The loss is the window's mean (skipped non-finite steps left out, and counted);
        `seconds_per_step` is the recent rate without compiling (None: the window's), for
        the ETA.
        """
        r, steps, elapsed = self.rates, self._steps, time.time() - self._started
        loss = float(np.mean(self._losses)) if self._losses else float("nan")
        steps_per_sec = steps / max(elapsed, 1e-9)
        examples_per_sec = steps_per_sec * r.examples_per_step
        tokens_per_sec = steps_per_sec * r.tokens_per_step
        mfu = flops.mfu(steps_per_sec * r.flops_per_step, r.peak_flops)
        rate = seconds_per_step if seconds_per_step is not None else elapsed / steps
        eta = datetime.timedelta(seconds=round((self.total_steps - step) * rate))
        skipped = self._skipped
        log.info(
            "step %d/%d | loss %.4f | %s tokens/s | %.1f examples/s | mfu %.1f%% | lr %.2e | grad_norm %.3f | eta %s%s",
            step, self.total_steps, loss, f"{tokens_per_sec:,.0f}", examples_per_sec, 100 * mfu, learning_rate,
            self._grad_norm, eta, f" | skipped {skipped} non-finite" if skipped else "",
        )
        record = {
            "kind": "train", "step": step, "loss": loss, "tokens_per_sec": tokens_per_sec,
            "examples_per_sec": examples_per_sec, "mfu": mfu, "time": time.time(),
            "learning_rate": learning_rate, "grad_norm": self._grad_norm, "skipped_steps": skipped,
        }
        if self.chief:
            self._append(record)
            self._summaries("train", step, {k: record[k] for k in TRAIN_SCALARS})
        self.reset_window()
        return record

    def eval(self, result: Mapping, seconds: float) -> None:
        """The line and record of one evaluation (`result` holds its step, metrics and counts)."""
        step = result["step"]
        log.info("eval at step %d | %s | %d examples in %d steps, %.1fs", step,
                 " | ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float)),
                 result["num_examples"], result["eval_steps"], seconds)
        if self.chief:
            self._append({"kind": "eval", **result, "time": time.time()})
            self._summaries("eval", step, {k: v for k, v in result.items() if isinstance(v, float)})
            self._writers["eval"].flush()

    def goodput(self, step: int, summary: Mapping) -> None:
        """A `kind: "goodput"` record (tfpod.goodput: goodput and badput over all launches so far)."""
        if self.chief:
            self._append({"kind": "goodput", "step": step, **summary, "time": time.time()})

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()
