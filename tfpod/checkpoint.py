"""Checkpoints of the sharded training state, and what makes a resume exact.

One `tf.train.Checkpoint` holds the model and optimizer DVariables (the optimizer's
step counter is the global step). Every host takes part in the sharded write and read.
`CheckpointManager` resumes from the newest checkpoint in `model_dir` that is complete
and readable, saves every `checkpoint_every` steps and at the end, and keeps the last
`keep` checkpoints. Each host's input position is saved beside it (`InputCheckpoint`).

A resumed run repeats an uninterrupted one exactly because everything a step depends
on is restored or is a function of the step: weights, optimizer slots and step (the
sharded checkpoint), the input position (`InputCheckpoint`), synthetic batches (seeded
by the step) and dropout masks (tfpod.partitioning.dropout: seeded by the step, not by a
random state that a killed process loses).

Writes are atomic: TensorFlow writes a checkpoint's files under temporary names and
renames them, and the `checkpoint` state file last. With `async_save`
(train.async_checkpoint) tfpod.checkpoint_writer writes the same files in a background
thread, each host its own shards, and records the checkpoint once it is whole. A
checkpoint missing a data shard is skipped (`complete_steps`); one whose files fail
their checksums is reported, moved aside and the one before it used
(`CheckpointManager.restore_latest`).

No checkpoint is written of non-finite state: `save` first checks every weight and
optimizer slot for NaN and Inf (`NonfiniteState`), so the newest checkpoint is always
one a run can go on from, and keeping the newest `keep` never drops the last finite one.

`Preemption` turns SIGTERM (tfpod.preemption's flag) into "finish this step, save, exit 0", agreed by all hosts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Callable

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, checkpoint_writer, compat, preemption, runtime
from tfpod.partitioning import report, stages

log = logging.getLogger("tfpod")


def complete_steps(directory: str) -> list[int]:
    """Steps of the checkpoints in `directory` whose index and every data shard are on disk, ascending.

    A host that dies while saving leaves a checkpoint that the manager's bookkeeping
    may already name but whose files are partial; such a one is skipped.
    """
    steps = []
    for index in tf.io.gfile.glob(os.path.join(directory, "ckpt-*.index")):
        prefix = index[: -len(".index")]
        number = prefix.rsplit("-", 1)[1]
        if not number.isdigit():  # ckpt-N.corrupt.K: moved aside
            continue
        data = tf.io.gfile.glob(prefix + ".data-*-of-*")
        if data and len(data) == int(data[0].rsplit("-of-", 1)[1]):
            steps.append(int(number))
    return sorted(steps)


class CheckpointManager:
    """Saves and restores {name: trackable} under model_dir/checkpoints."""

    def __init__(self, model_dir: str, step: tf.Variable, keep: int = 3, async_save: bool = False, **trackables):
        if keep < 1:
            raise UserError(f"train.keep_checkpoints={keep} must be at least 1")
        self.directory = os.path.join(model_dir, "checkpoints")
        self._step = step
        self._ckpt = tf.train.Checkpoint(**trackables)
        self._model = trackables.get("model")
        self._manager = tf.train.CheckpointManager(self._ckpt, self.directory, max_to_keep=keep, step_counter=step)
        # Asynchronous saves (tfpod.checkpoint_writer): a checkpoint is recorded, and the
        # oldest deleted, once it is whole, so `keep` complete ones stay on disk meanwhile.
        self._writer = checkpoint_writer.BackgroundWriter(self._ckpt, dtensor.client_id(), dtensor.num_clients()) \
            if async_save else None
        self._writing = None
        # A save or restore names its files on DTensor's default mesh: make that the step's
        # (pipeline stages' variables are saved through the first stage, stages.save_through).
        layout = getattr(compat.inner_variable(step), "layout", None)
        self._mesh = (lambda: dtensor.default_mesh(layout.mesh)) if layout is not None else contextlib.nullcontext
        self._finite_counts, self._keys = None, []  # the compiled check of `nonfinite`, made at its first use

    @property
    def latest(self) -> str | None:
        """The newest complete checkpoint on disk (never one moved aside or left partial)."""
        steps = self.complete_steps()
        return os.path.join(self.directory, f"ckpt-{steps[-1]}") if steps else None

    def complete_steps(self) -> list[int]:
        return complete_steps(self.directory)

    def restore(self, path: str) -> int:
        """Restores a given checkpoint (a prefix such as model_dir/checkpoints/ckpt-40)."""
        if not tf.io.gfile.exists(path + ".index"):
            raise UserError(f"--checkpoint={path}: no such checkpoint (expected {path}.index)")
        self._restore(path, "use the gin config it was trained with")
        return int(self._step.numpy())

    def _restore(self, path: str, fix: str) -> None:
        """Restores `path` after checking it holds exactly this model's variables and shapes.

        Raises:
          UserError: the checkpoint is of another model (names the variables that differ).
          tf.errors.DataLossError: its files are corrupt (checksum or format).
        """
        self.wait()
        problem = mismatch(self._ckpt, path)
        if problem:
            raise UserError(f"checkpoint {path} is not of this model: {problem}; {fix}")
        try:
            with self._mesh():
                self._ckpt.restore(path).assert_existing_objects_matched()
            stages.apply_restored()  # pipeline stages' variables, read through the first stage
        except (AssertionError, ValueError) as e:
            raise UserError(f"checkpoint {path} is not of this model ({first_line(e)}); {fix}") from None

    def restore_weights(self, path: str, what: str) -> None:
        """Only the model's weights of checkpoint `path` (not the optimizer state or the step).

        Raises:
          UserError: the checkpoint is of another model (`what` names the setting that gave it).
        """
        read_weights(self._model, path, f"{what}={path}", "pass a checkpoint of the same model config", self._mesh)

    def restore_latest(self) -> int | None:
        """Restores the newest complete, readable checkpoint if there is one; returns its step or None.

        A checkpoint missing data shards (a host stopped while saving) is skipped; one whose
        files fail to read (checksum mismatch, truncated) is moved aside to
        `ckpt-N.corrupt.*`, and one holding a NaN or Inf (tfpod writes none; an older
        version could) to `ckpt-N.nonfinite.*`, so that no later save writes over them,
        and the one before is used.
        """
        steps = self.complete_steps()
        latest = self._manager.latest_checkpoint
        if not steps:
            if latest:
                log.warning("checkpoint %s is incomplete and no complete one exists: starting from scratch", latest)
            return None
        if latest and latest != os.path.join(self.directory, f"ckpt-{steps[-1]}"):
            log.warning("newest checkpoint %s is incomplete (a host stopped while saving): skipping it", latest)
        fix = "use the gin config it was trained with, or a new --model_dir"
        for step in reversed(steps):
            path = os.path.join(self.directory, f"ckpt-{step}")
            try:
                verify(path)
            except NonfiniteCheckpoint as e:  # written by an older tfpod, or by hand: never resumed from
                moved = quarantine(path, "nonfinite") if dtensor.client_id() == 0 else "*.nonfinite.* by host 0"
                log.warning("checkpoint %s holds non-finite values (%s): moved it to %s; trying the one before it",
                            path, e, moved)
                continue
            except (tf.errors.OpError, RuntimeError) as e:
                # every host finds the same files corrupt; host 0 alone moves them
                moved = quarantine(path) if dtensor.client_id() == 0 else "*.corrupt.* by host 0"
                log.warning("checkpoint %s is corrupt (%s): moved it to %s; trying the one before it",
                            path, first_line(e), moved)
                continue
            self._restore(path, fix)
            restored = int(self._step.numpy())
            log.info("resumed from %s at step %d", path, restored)
            return restored
        raise UserError(f"every checkpoint in {self.directory} is corrupt or non-finite (moved aside as "
                        "*.corrupt.* or *.nonfinite.*): restore the folder from a backup, or start a new --model_dir")

    def nonfinite(self) -> list[str]:
        """The saved variables (weights, optimizer slots) holding a NaN or Inf now, by checkpoint key.

        One compiled pass over the state of each mesh (pipeline stages hold theirs on their
        own; each variable's count of non-finite values, reduced over the mesh), so every
        host gets the same answer.
        """
        if self._finite_counts is None:
            keyed = [(k, v) for k, v in variables_by_key(self._ckpt).items() if v.dtype.is_floating]
            groups: dict[str, list] = {}
            for k, v in keyed:
                layout = getattr(compat.inner_variable(v), "layout", None)
                groups.setdefault(layout.mesh.to_string() if layout is not None else "", []).append((k, v))
            self._keys = [k for members in groups.values() for k, _ in members]
            self._finite_counts = [nonfinite_counts([v for _, v in members]) for members in groups.values()]
        counts = np.concatenate([runtime.to_host(fn()) for fn in self._finite_counts])
        return [self._keys[i].split("/.ATTRIBUTES")[0] for i in np.flatnonzero(counts)]

    def check_finite(self) -> None:
        """Raises NonfiniteState when any saved variable holds a NaN or Inf (see `nonfinite`)."""
        bad = self.nonfinite()
        if bad:
            raise NonfiniteState(int(self._step.numpy()), bad, self.latest)

    def save(self, checked: bool = False) -> str:
        """Writes a checkpoint of the current step, never of non-finite state (NonfiniteState).

        With `async_save` each host's shards are copied off the devices and written by a
        background thread while training goes on (tfpod.checkpoint_writer); the next save
        (and `wait`) first waits for it.

        Args:
          checked: the caller ran `check_finite` since the last update.
        """
        if not checked:
            self.check_finite()
        self.wait()
        step = int(self._step.numpy())
        started = time.time()
        try:
            with self._mesh():
                if self._writer is None:
                    path = self._manager.save(checkpoint_number=step)
                else:
                    self._ckpt.save_counter.assign_add(1)  # as the manager's save counts
                    path = os.path.join(self.directory, f"ckpt-{step}")
                    copied, held = self._writer.start(path, lambda p: compat.record_checkpoint(self._manager, p))
        except (tf.errors.OpError, OSError) as e:  # a full disk, a quota, a lost mount
            self._failed(step, e)
        if self._writer is not None:
            self._writing = (step, path, started)
            log.info("writing checkpoint %s in the background (this host's %s copied off the devices in %.2f s)",
                     path, report.human_bytes(held), copied)
        else:
            log.info("saved checkpoint %s", path)
        return path

    def wait(self) -> None:
        """Waits for a checkpoint being written in the background (async_save), if any."""
        if self._writing is None:
            return
        step, path, started = self._writing
        self._writing = None
        try:
            self._writer.wait()
        except (tf.errors.OpError, OSError, checkpoint_writer.WriteFailed) as e:
            self._failed(step, e)
        log.info("saved checkpoint %s (written in the background, %.1f s after the step)", path, time.time() - started)

    def _failed(self, step: int, e: BaseException):
        self._remove_partial(step)
        raise UserError(f"checkpoint of step {step} could not be written to {self.directory} "
                        f"({first_line(runtime.error_cause(e))}): free space there (or fix the error) and rerun to resume; "
                        f"{newest_checkpoint(self.latest)}") from None

    def _remove_partial(self, step: int) -> None:
        """Removes what a failed save of `step` left (host 0; complete_steps ignores it anyway)."""
        if dtensor.client_id() != 0:
            return
        prefix = os.path.join(self.directory, f"ckpt-{step}")
        if tf.io.gfile.exists(prefix + ".index"):
            return  # complete after all
        for f in tf.io.gfile.glob(prefix + "_temp*") + tf.io.gfile.glob(prefix + ".data-*"):
            try:
                (tf.io.gfile.rmtree if tf.io.gfile.isdir(f) else tf.io.gfile.remove)(f)
            except tf.errors.OpError:
                pass


def nonfinite_counts(variables: list) -> Callable[[], tf.Tensor]:
    """A compiled function of no arguments: each variable's count of NaN and Inf values.

    The variables are captured, not passed: passed (as a default argument) they made
    tf.function trace and compile again at every call inside training, 15 s a save for
    gpt_small.
    """
    count = lambda v: tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(v)), tf.float32))
    return tf.function(lambda: tf.stack([count(v) for v in variables]))


class NonfiniteState(UserError):
    """The training state holds a NaN or Inf, so no checkpoint is written of it."""

    def __init__(self, step: int, variables: list[str], newest: str | None):
        self.step, self.variables, self.newest = step, variables, newest
        names = ", ".join(variables[:3]) + (f" and {len(variables) - 3} more" if len(variables) > 3 else "")
        super().__init__(
            f"the weights or optimizer state at step {step} hold NaN or Inf ({names}): no checkpoint is written "
            f"of them; {newest_checkpoint(newest)}: lower optimizer.learning_rate, raise optimizer.warmup_steps "
            "or set optimizer.clip_norm"
        )


def read_weights(model, path: str, where: str, fix: str, scope=contextlib.nullcontext) -> None:
    """Reads only `model`'s weights from checkpoint `path` (its optimizer state is left),
    within `scope` (e.g. the default mesh a DTensor restore names its files on).

    Raises:
      UserError: "`where` is not of this model" (the variables that differ) or does not fit
        it, then `fix`.
    """
    ckpt = tf.train.Checkpoint(model=model)
    problem = mismatch(ckpt, path, weights_only=True)
    if problem:
        raise UserError(f"{where} is not of this model: {problem}; {fix}")
    try:
        with scope():
            status = ckpt.restore(path)
            status.assert_existing_objects_matched()
    except (AssertionError, ValueError) as e:
        raise UserError(f"{where} does not fit this model ({first_line(e)}): {fix}") from None
    status.expect_partial()  # the optimizer's state is not read
    stages.apply_restored()  # pipeline stages' variables, read through the first stage


def resolve(path: str, what: str) -> str:
    """A checkpoint prefix (D/checkpoints/ckpt-N), or a run's folder or its checkpoints
    folder: the newest complete checkpoint there. One UserError line when there is none."""
    if tf.io.gfile.exists(path + ".index"):
        return path
    for directory in (os.path.join(path, "checkpoints"), path):
        steps = complete_steps(directory) if tf.io.gfile.isdir(directory) else []
        if steps:
            return os.path.join(directory, f"ckpt-{steps[-1]}")
    raise UserError(f"{what}={path}: no checkpoint there (expected a prefix such as D/checkpoints/ckpt-N with its "
                    ".index file, or a run's folder holding checkpoints/)")


def newest_checkpoint(path: str | None) -> str:
    """Says which checkpoint a rerun resumes from (every checkpoint tfpod writes holds finite values)."""
    if path is None:
        return "no checkpoint was written yet"
    return f"the newest checkpoint, {path}, holds finite values and a rerun resumes from it"


class NonfiniteCheckpoint(ValueError):
    """A checkpoint on disk holds a NaN or Inf."""


def write_atomically(path: str, text: str) -> None:
    """Writes `text` to `path` through a temporary file renamed into place: a reader (or a
    crash) sees the old file or the new one, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def first_line(e: BaseException) -> str:
    """An exception's first line (at most 300 characters), for one-line messages."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def verify(path: str) -> None:
    """Reads every tensor of checkpoint `path` on the host, checking each one's checksum and values.

    A failed read inside the sharded restore would poison the eager executor, so the
    files are checked first, without the mesh, one tensor at a time.

    Raises:
      tf.errors.OpError: a file is corrupt or truncated (a checksum or the format fails).
      NonfiniteCheckpoint: a tensor holds a NaN or Inf (names the first).
    """
    reader = tf.train.load_checkpoint(path)
    for key in sorted(reader.get_variable_to_shape_map()):
        value = reader.get_tensor(key)
        if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise NonfiniteCheckpoint(key.split("/.ATTRIBUTES")[0])


def quarantine(path: str, kind: str = "corrupt") -> str:
    """Renames checkpoint `path`'s files to `path.<kind>.<n>...`; returns the new prefix."""
    n = 0
    while tf.io.gfile.glob(f"{path}.{kind}.{n}*"):
        n += 1
    target = f"{path}.{kind}.{n}"
    for f in tf.io.gfile.glob(path + ".*"):
        if ".corrupt." not in f and ".nonfinite." not in f:
            tf.io.gfile.rename(f, target + f[len(path):])
    return target


def variables_by_key(ckpt: tf.train.Checkpoint) -> dict[str, tf.Variable]:
    """{checkpoint key: variable} of every variable `ckpt` saves (optimizer slots included)."""
    return compat.checkpoint_objects(ckpt)


def mismatch(ckpt: tf.train.Checkpoint, path: str, show: int = 3, weights_only: bool = False) -> str | None:
    """What differs between the variables in checkpoint `path` and those `ckpt` holds (None: they match).

    Names up to `show` variables of each kind: missing from the checkpoint, in the
    checkpoint but not in the model, and stored with another shape. With `weights_only`,
    the checkpoint's optimizer state is not counted as extra (`ckpt` holds only `model`).
    """
    stored = {k: tuple(v) for k, v in tf.train.list_variables(path)
              if k.endswith("/.ATTRIBUTES/VARIABLE_VALUE") and not k.startswith("save_counter/")
              and not (weights_only and (k.startswith("optimizer/") or "/.OPTIMIZER_SLOT/" in k))}
    expected = {k: tuple(v.shape.as_list()) for k, v in variables_by_key(ckpt).items()
                if not k.startswith("save_counter/")}
    short = lambda k: k[: -len("/.ATTRIBUTES/VARIABLE_VALUE")]
    listed = lambda keys: ", ".join(keys[:show]) + (f" and {len(keys) - show} more" if len(keys) > show else "")
    parts = []
    order = lambda k: (".OPTIMIZER_SLOT" in k, k)  # weights first, then optimizer slots
    missing = [short(k) for k in sorted(expected.keys() - stored.keys(), key=order)]
    extra = [short(k) for k in sorted(stored.keys() - expected.keys(), key=order)]
    shapes = [f"{short(k)} {list(stored[k])} vs {list(v)} here" for k, v in sorted(expected.items(), key=lambda kv: order(kv[0]))
              if k in stored and stored[k] != v]
    if missing:
        parts.append(f"{len(missing)} variable(s) of this model are not in it ({listed(missing)})")
    if extra:
        parts.append(f"{len(extra)} of its variable(s) are not in this model ({listed(extra)})")
    if shapes:
        parts.append(f"{len(shapes)} shape(s) differ ({listed(shapes)})")
    return "; ".join(parts) or None


def any_host(mesh: dtensor.Mesh, flag: bool) -> bool:
    """Whether `flag` is true on any host (a max over every device of the mesh)."""
    rank = len(mesh.dim_names)
    layout = dtensor.Layout(list(mesh.dim_names), mesh)  # one element per device
    local = [tf.fill([1] * rank, 1.0 if flag else 0.0)] * len(mesh.local_devices())
    packed = dtensor.pack(local, layout)
    total = _reduce_max(packed)
    return bool(dtensor.unpack(total)[0].numpy() > 0)


@tf.function
def _reduce_max(x):
    return tf.reduce_max(x)


class Preemption:
    """SIGTERM (a scheduler's preemption notice) as a request to save and stop.

    While active, SIGTERM only sets a flag; the trainer asks `requested()` after each
    call of the compiled loop, then saves a checkpoint and returns. On several hosts the
    hosts agree (`any_host`), so all stop after the same step even when the signal
    reaches them at different times. Used as a context manager around training; the
    handler stays when `preemption.catch_sigterm` installed it before.
    """

    def __init__(self, mesh: dtensor.Mesh, num_clients: int):
        self.mesh, self.num_clients = mesh, num_clients
        self._previous = None

    def __enter__(self) -> "Preemption":
        self._previous = preemption.install()  # None when catch_sigterm installed it first
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            preemption.uninstall(self._previous)
            self._previous = None

    @property
    def signaled(self) -> bool:
        """Whether this host received SIGTERM."""
        return preemption.received()

    def requested(self) -> bool:
        """Whether any host received SIGTERM (a collective when there are several hosts)."""
        if self.num_clients == 1:
            return self.signaled
        return any_host(self.mesh, self.signaled)


class InputCheckpoint:
    """One host's input position (its tf.data iterator), saved beside each model checkpoint.

    A tf.data iterator cannot share a tf.train.Checkpoint with DVariables, so every host
    keeps its own small checkpoint in model_dir/checkpoints/input-host<h>/, numbered by
    the same step as the model checkpoint it belongs to. It is written before the model
    checkpoint, so the newest model checkpoint always has its input position.

    Beside each one, `ckpt-<step>.source.json` records what the input was built from
    (the data config, this host's files and their sizes, the row length, vocabulary,
    batch rows, seed and host count). A position is restored only into the same input:
    a changed file, format or batch would otherwise go on feeding the old data (the
    position replays the old stream) or fail deep inside tf.data.
    """

    def __init__(self, model_dir: str, host_id: int, iterator, keep: int = 3, source: dict | None = None):
        self.directory = os.path.join(model_dir, "checkpoints", f"input-host{host_id}")
        self.source = source
        self._ckpt = tf.train.Checkpoint(iterator=iterator)
        self._manager = tf.train.CheckpointManager(self._ckpt, self.directory, max_to_keep=keep)

    def save(self, step: int) -> None:
        try:
            if self.source is not None:  # first: the position never exists without what it describes
                os.makedirs(self.directory, exist_ok=True)
                write_atomically(self._source_path(step), json.dumps(self.source, indent=1, sort_keys=True))
            self._manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as e:  # a full disk, a quota, a lost mount
            raise UserError(f"the input position of step {step} could not be written to {self.directory} "
                            f"({first_line(runtime.error_cause(e))}): free space there (or fix the error) and rerun "
                            "to resume; the checkpoints already there are intact") from None
        kept = {os.path.basename(p) for p in self._manager.checkpoints}
        for f in tf.io.gfile.glob(os.path.join(self.directory, "ckpt-*.source.json")):
            if os.path.basename(f)[: -len(".source.json")] not in kept:
                tf.io.gfile.remove(f)

    def _source_path(self, step: int) -> str:
        return os.path.join(self.directory, f"ckpt-{step}.source.json")

    def restore(self, step: int, strict: bool = False) -> str:
        """Restores the position saved with the model checkpoint of `step`, if it fits this input.

        Returns:
          "restored"; "skipped" (no position was saved, or the input changed: the iterator
          is untouched, at the input's beginning); or "failed" (tf.data could not restore it
          into this pipeline: the caller starts over with a new dataset). A warning says
          why it was not restored.

        Raises:
          UserError: with `strict` (train.strict_resume), instead of starting over.
        """
        path = os.path.join(self.directory, f"ckpt-{step}")
        if not tf.io.gfile.exists(path + ".index"):
            return self._cannot(step, f"checkpoint step {step} has no input position in {self.directory} (the run "
                                      "that wrote it read synthetic data, the tf.data service, or another host count)",
                                strict, "skipped")
        stored = None
        if tf.io.gfile.exists(self._source_path(step)):
            with tf.io.gfile.GFile(self._source_path(step)) as f:
                stored = json.load(f)
        # A setting the stored record lacks (one a later tfpod added) cannot have been changed by that run.
        if stored is not None and self.source is not None and stored != {k: self.source.get(k) for k in stored}:
            return self._cannot(step, f"the input changed since checkpoint step {step} "
                                      f"({source_changes(stored, self.source)})", strict, "skipped")
        try:
            self._ckpt.restore(path).assert_existing_objects_matched()
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
