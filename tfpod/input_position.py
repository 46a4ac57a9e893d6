"""Each host's input position (its tf.data iterator), saved beside every model checkpoint.

A tf.data iterator cannot share a tf.train.Checkpoint with DVariables, so every host
keeps its own small checkpoint in model_dir/checkpoints/input-host<h>/, numbered by the
same step as the model checkpoint it belongs to (tfpod.checkpoint). It is written before
the model checkpoint, so the newest model checkpoint always has its input position.

Beside each one, `ckpt-<step>.source.json` records what the input was built from (the
data config, this host's files and their sizes, the row length, vocabulary, batch rows,
seed and host count). A position is restored only into the same input: a changed file,
format or batch would otherwise go on feeding the old data (the position replays the old
stream) or fail deep inside tf.data. A position that cannot be restored (changed input,
damaged files) starts the input from its beginning with one warning naming why, or, with
`train.strict_resume`, stops the run with that line.
"""

from __future__ import annotations

import json
import logging
import os

import tensorflow as tf

from tfpod import UserError, runtime
from tfpod.checkpoint import first_line, open_manager, write_atomically

log = logging.getLogger("tfpod")


class InputCheckpoint:
    """One host's input position: save it at a step, restore it at a resumed step."""

    def __init__(self, model_dir: str, host_id: int, iterator, keep: int = 3, source: dict | None = None):
        self.directory = os.path.join(model_dir, "checkpoints", f"input-host{host_id}")
        self.source = source
        self._ckpt = tf.train.Checkpoint(iterator=iterator)
        steps = sorted(int(p[len("ckpt-"):-len(".index")]) for p in
                       (os.path.basename(f) for f in tf.io.gfile.glob(os.path.join(self.directory, "ckpt-*.index")))
                       if p[len("ckpt-"):-len(".index")].isdigit())
        self._manager = open_manager(self._ckpt, self.directory, keep, steps)

    def save(self, step: int) -> None:
        try:
            self._write_source(self.directory, step)  # first: the position never exists without what it describes
            self._manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as e:  # a full disk, a quota, a lost mount
            raise UserError(f"the input position of step {step} could not be written to {self.directory} "
                            f"({first_line(runtime.error_cause(e))}): free space there (or fix the error) and rerun "
                            "to resume; the checkpoints already there are intact") from None
        kept = {os.path.basename(p) for p in self._manager.checkpoints}
        for f in tf.io.gfile.glob(os.path.join(self.directory, "ckpt-*.source.json")):
            if os.path.basename(f)[: -len(".source.json")] not in kept:
                tf.io.gfile.remove(f)

    def _write_source(self, directory: str, step: int) -> None:
        if self.source is not None:
            os.makedirs(directory, exist_ok=True)
            write_atomically(self._source_path(step, directory), json.dumps(self.source, indent=1, sort_keys=True))

    def _source_path(self, step: int, directory: str | None = None) -> str:
        return os.path.join(directory or self.directory, f"ckpt-{step}.source.json")

    def write_to(self, directory: str, step: int) -> None:
        """Writes the position of `step` and its source to `directory` (an in-memory snapshot's,
        tfpod.memory_checkpoint), as `save` does to this host's folder of positions."""
        os.makedirs(directory, exist_ok=True)
        self._write_source(directory, step)
        # The count of saves, created now if no save made it yet: `restore` checks that every
        # object it holds got a value, and `write` leaves out a count that does not exist.
        self._ckpt.save_counter  # noqa: B018
        self._ckpt.write(os.path.join(directory, f"ckpt-{step}"))

    def restore(self, step: int, strict: bool = False, directory: str | None = None) -> str:
        """Restores the position saved with the model checkpoint of `step`, if it fits this input
        (`directory`: where it was saved, if not this host's folder of positions: a snapshot's).

        Returns:
          "restored"; "skipped" (no position was saved, the input changed, or what it was
          built from is unreadable: the iterator is untouched, at the input's beginning); or
          "failed" (tf.data could not restore it into this pipeline, or its files are
          damaged: the caller starts over with a new dataset). A warning says why it was
          not restored.

        Raises:
          UserError: with `strict` (train.strict_resume), instead of starting over.
        """
        directory = directory or self.directory
        path = os.path.join(directory, f"ckpt-{step}")
        if not tf.io.gfile.exists(path + ".index"):
            return self._cannot(step, f"checkpoint step {step} has no input position in {directory} (the run "
                                      "that wrote it read synthetic data, the tf.data service, or another host count)",
                                strict, "skipped")
        stored = None
        if tf.io.gfile.exists(self._source_path(step, directory)):
            try:
                with tf.io.gfile.GFile(self._source_path(step, directory)) as f:
                    stored = json.load(f)
            except (tf.errors.OpError, ValueError) as e:
                return self._cannot(step, f"{self._source_path(step, directory)} is damaged ({first_line(e)}), so the input "
                                          "position beside it cannot be checked against this input; restore the file "
                                          "from a backup to resume the input exactly", strict, "skipped")
        # A setting the stored record lacks (one a later tfpod added) cannot have been changed by that run.
        if stored is not None and self.source is not None and stored != {k: self.source.get(k) for k in stored}:
            return self._cannot(step, f"the input changed since checkpoint step {step} "
                                      f"({source_changes(stored, self.source)})", strict, "skipped")
        try:
            self._ckpt.restore(path).assert_existing_objects_matched()
        except tf.errors.DataLossError as e:
            return self._cannot(step, f"the input position {path} is damaged ({first_line(e)}); restore its files "
                                      "from a backup to resume the input exactly", strict, "failed")
        except (tf.errors.OpError, AssertionError, ValueError) as e:
            return self._cannot(step, f"the input position saved at step {step} does not fit this input pipeline "
                                      f"({first_line(e)})", strict, "failed")
        log.info("input resumed at step %d from %s", step, path)
        return "restored"

    @staticmethod
    def _cannot(step: int, why: str, strict: bool, outcome: str) -> str:
        if strict:
            raise UserError(f"{why}: train.strict_resume=True will not start the input over; undo the change, or set "
                            "train.strict_resume=False to start the new input from its beginning")
        log.warning("%s: the input starts from its beginning at step %d, not where the checkpoint left it "
                    "(train.strict_resume=True refuses instead)", why, step)
        return outcome


def source_changes(before: dict, now: dict, show: int = 3) -> str:
    """What differs between two input sources, in a few words (`InputCheckpoint`)."""
    short = lambda v: (repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "...")
    parts = []
    for key in sorted(before):
        old, new = before.get(key), now.get(key)
        if old == new:
            continue
        if key == "files" and old is not None and new is not None:
            gone = [f for f, _ in old if f not in {g for g, _ in new}]
            added = [f for f, _ in new if f not in {g for g, _ in old}]
            resized = [f for f, size in new if [f, size] not in old and f not in added]
            parts.append("this host's files: " + ", ".join(
                f"{len(v)} {what} (e.g. {os.path.basename(v[0])})"
                for what, v in (("gone", gone), ("new", added), ("changed size", resized)) if v))
        else:
            parts.append(f"{key}: {short(old)} -> {short(new)}")
    return "; ".join(parts[:show]) + (f"; and {len(parts) - show} more" if len(parts) > show else "")
