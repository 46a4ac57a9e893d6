"""What a run does when a step's loss or gradient norm is NaN or Inf (train.on_nonfinite).

The compiled step never applies such a step's update (optimizers.Update.step) and no
checkpoint is written of non-finite state (checkpoint.CheckpointManager.save); after
each call of the loop `NonfiniteGuard` stops the run naming the newest checkpoint,
logs and counts skipped steps, or rolls back to the newest checkpoint.
"""

from __future__ import annotations

import logging

import numpy as np

from tfpod import UserError, checkpoint

log = logging.getLogger("tfpod")

POLICIES = ("stop", "skip", "rollback")


def _nonfinite_text(loss: float, norm: float, step: int) -> str:
    if not np.isfinite(loss):
        return f"loss became {loss} at step {step}"
    return f"gradient norm became {norm} at step {step} (loss {loss:.4g})"


class NonfiniteGuard:
    """Applies train.on_nonfinite after each call of the compiled loop (see controller.TrainConfig).

    The compiled step has already dropped the update of every step whose loss or
    gradient norm is not finite; this decides whether the run stops, goes on, or goes
    back to the newest checkpoint, and says so.
    """

    def __init__(self, policy: str, max_nonfinite: int, checkpoints: checkpoint.CheckpointManager):
        self.policy, self.max_nonfinite, self.checkpoints = policy, max_nonfinite, checkpoints
        self.skipping = 0  # skip: steps skipped in a row, across calls
        self.rollbacks = 0  # rollback: rollbacks since the last save

    def saved(self) -> None:
        self.rollbacks = 0

    def check(self, step: int, losses: np.ndarray, norms: np.ndarray) -> int | None:
        """Stops, skips (logs) or rolls back for the non-finite steps step+1... of one call.

        Returns:
          The step rolled back to, or None when training goes on from step + len(losses).
        """
        bad = [(step + i + 1, float(x), float(n)) for i, (x, n) in enumerate(zip(losses, norms))
               if not (np.isfinite(x) and np.isfinite(n))]
        if self.policy == "skip":
            for i, (x, n) in enumerate(zip(losses, norms)):
                if np.isfinite(x) and np.isfinite(n):
                    self.skipping = 0
                    continue
                self.skipping += 1
                if self.skipping > self.max_nonfinite:
                    self._stop(step + i + 1, float(x), float(n), f" after skipping {self.max_nonfinite} steps in a row")
                log.warning("%s: skipped its update (train.on_nonfinite='skip', %d in a row, at most %d)",
                            _nonfinite_text(float(x), float(n), step + i + 1), self.skipping, self.max_nonfinite)
            return None
        if not bad:
            return None
        first, loss, norm = bad[0]
        if self.policy == "stop":
            self._stop(first, loss, norm)
        return self.roll_back(_nonfinite_text(loss, norm, first))

    def roll_back(self, what: str) -> int:
        """Restores the newest checkpoint (rollback policy) for `what` went non-finite; returns its step."""
        self.rollbacks += 1
        if self.rollbacks > self.max_nonfinite:
            raise UserError(f"{what} after {self.max_nonfinite} rollback(s) without reaching a new checkpoint: "
                            f"{checkpoint.newest_checkpoint(self.checkpoints.latest)}; " + _FIXES)
        if self.checkpoints.latest is None:
            raise UserError(f"{what} with no checkpoint yet to roll back to; " + _FIXES)
        restored = self.checkpoints.restore_latest()
        log.warning("%s: rolled back to the checkpoint of step %d; training goes on with the next batches "
                    "(train.on_nonfinite='rollback', %d of %d)", what, restored, self.rollbacks, self.max_nonfinite)
        return restored

    def _stop(self, step: int, loss: float, norm: float, why: str = "") -> None:
        raise UserError(f"{_nonfinite_text(loss, norm, step)}{why}: its update was not applied; "
                        f"{checkpoint.newest_checkpoint(self.checkpoints.latest)}; {_FIXES}")


_FIXES = ("lower optimizer.learning_rate, raise optimizer.warmup_steps, set optimizer.clip_norm, or set "
          "train.on_nonfinite='skip' or 'rollback'")
