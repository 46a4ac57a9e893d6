"""Checkpoints of the sharded training state, and what makes a resume exact.

One `tf.train.Checkpoint` holds the model and optimizer DVariables (the optimizer's
step counter is the global step). Every host takes part in the sharded write and read.
`CheckpointManager` resumes from the newest checkpoint in `model_dir` that is complete
and readable, saves every `checkpoint_every` steps and at the end, and keeps the last
`keep` checkpoints. Each host's input position is saved beside it (tfpod.input_position).

A resumed run repeats an uninterrupted one exactly because everything a step depends
on is restored or is a function of the step: weights, optimizer slots and step (the
sharded checkpoint), the input position (tfpod.input_position), synthetic batches (seeded
by the step) and dropout masks (tfpod.partitioning.dropout: seeded by the step, not by a
random state that a killed process loses).

Writes are atomic: tfpod.checkpoint_writer writes each host's shards under
`ckpt-N_temp/`, host 0 merges them into `ckpt-N` (the index last), and the checkpoint is
then recorded in the `checkpoint` state file. A save returns when that is done; with
`async_save` (train.async_checkpoint) it goes on in a background thread while training
goes on. The files are those TensorFlow's own sharded save writes, and
`tf.train.Checkpoint.restore` reads them onto any mesh. A checkpoint with an index whose
data shards are missing or mixed from two writes is damaged (`scan`); it, and one whose
files fail their checksums, is reported, moved aside and the one before it used
(`CheckpointManager.restore_latest`). A damaged `checkpoint` state file is moved aside
and rebuilt (`open_manager`). One run writes a folder at a time (tfpod.run_folder).

No checkpoint is written of non-finite state: `check_finite` copies every weight and
optimizer slot off the devices and checks the copy for NaN and Inf (`NonfiniteState`),
and `save` writes that copy, so the newest checkpoint is always one a run can go on
from, and keeping the newest `keep` never drops the last finite one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, checkpoint_writer, compat, lora, memory_checkpoint, mesh as meshlib, run_folder, runtime
from tfpod.partitioning import report
from tfpod.train_state import TrainState

log = logging.getLogger("tfpod")

SAVE_COUNTER = "save_counter/.ATTRIBUTES/VARIABLE_VALUE"  # the checkpoint key of tf.train.Checkpoint's count of saves


def complete_steps(directory: str) -> list[int]:
    """Steps of the checkpoints in `directory` whose index and every data shard are on disk, ascending."""
    return scan(directory)[0]


def scan(directory: str) -> tuple[list[int], list[int]]:
    """(complete, damaged) checkpoint steps in `directory`, each ascending.

    Complete: the index and exactly the data shards one write makes (`.data-0000i-of-0000K`
    for i < K). Damaged: an index whose data shards are missing or mixed from different
    writes (two runs writing one folder at once left such ones). Every tfpod write puts
    the index last, so a write stopped midway leaves no index: data shards without one
    are neither (a later save of that step replaces them).
    """
    complete, damaged = [], []
    for index in tf.io.gfile.glob(os.path.join(directory, "ckpt-*.index")):
        prefix = index[: -len(".index")]
        number = prefix.rsplit("-", 1)[1]
        if not number.isdigit():  # ckpt-N.corrupt.K: moved aside
            continue
        shards = {tuple(int(x) for x in f.rsplit(".data-", 1)[1].split("-of-"))
                  for f in tf.io.gfile.glob(prefix + ".data-*-of-*")}
        counts = {k for _, k in shards}
        whole = len(counts) == 1 and shards == {(i, *counts) for i in range(*counts)}
        (complete if whole else damaged).append(int(number))
    return sorted(complete), sorted(damaged)


def open_manager(ckpt: tf.train.Checkpoint, directory: str, keep: int, steps: list[int], chief: bool = True,
                 **kwargs) -> tf.train.CheckpointManager:
    """A tf.train.CheckpointManager of `directory`, its `checkpoint` state file checked first.

    A damaged state file (the list of checkpoints, which TensorFlow would ignore and then
    write over) is moved aside by the `chief` with one warning, and the list is rebuilt
    from the newest `keep` of `steps` (the complete checkpoints on disk; older ones are
    left on disk, never deleted).
    """
    state = os.path.join(directory, "checkpoint")
    damaged = None
    if tf.io.gfile.exists(state):
        try:
            if tf.train.get_checkpoint_state(directory) is None:  # TensorFlow logs the parse error and gives up
                damaged = "not a checkpoint list"
        except ValueError as e:
            damaged = first_line(e)
    if damaged and chief:
        moved = run_folder.move_aside(state)
        log.warning("%s is damaged (%s): moved it to %s and rebuilt the list from the %d complete checkpoint(s) "
                    "on disk", state, damaged, moved, len(steps))
    manager = tf.train.CheckpointManager(ckpt, directory, max_to_keep=keep, **kwargs)
    if damaged and chief:
        for step in steps[-keep:]:
            compat.record_checkpoint(manager, os.path.join(directory, f"ckpt-{step}"))
    return manager


class CheckpointManager:
    """Saves and restores a run's TrainState (tfpod.train_state) under model_dir/checkpoints,
    and with `memory_every` its snapshots in each host's memory (tfpod.memory_checkpoint)."""

    def __init__(self, model_dir: str, state: TrainState, keep: int = 3, async_save: bool = False,
                 memory_every: int = 0, memory_dir: str | None = None):
        if keep < 1:
            raise UserError(f"train.keep_checkpoints={keep} must be at least 1")
        self.directory = os.path.join(model_dir, "checkpoints")
        self.state = state
        self._step = step = state.step
        self._ckpt = tf.train.Checkpoint(**state.trackables())
        # A reader beside a live run (an evaluation) leaves a damaged list to that run.
        mender = dtensor.client_id() == 0 and run_folder.live_holder(model_dir) is None
        self._manager = open_manager(self._ckpt, self.directory, keep, complete_steps(self.directory), mender,
                                     step_counter=step)
        # Every save goes through tfpod.checkpoint_writer: a checkpoint is recorded, and the
        # oldest deleted, once it is whole, so `keep` complete ones stay on disk meanwhile.
        self._writer = checkpoint_writer.BackgroundWriter(self._ckpt, dtensor.client_id(), dtensor.num_clients())
        self._async = async_save
        self._writing = None
        # A save or restore names its files on DTensor's default mesh: make that the step's
        # (pipeline stages' variables are saved through the first stage, stages.save_through).
        layout = getattr(compat.inner_variable(step), "layout", None)
        self._mesh = (lambda: dtensor.default_mesh(layout.mesh)) if layout is not None else contextlib.nullcontext
        self._step_mesh = layout.mesh if layout is not None else None
        with self._mesh():
            self._ckpt.save_counter  # created now (tf.train.Checkpoint makes it at the first save), so every copy holds it
        self._checked = None  # (step, this host's copy of the state) from `check_finite`
        self.fault = None  # tfpod.faults.Injector.at_save, for tests and soaks
        self.memory = None if not memory_every else memory_checkpoint.MemoryCheckpoints(
            model_dir, dtensor.client_id(), dtensor.num_clients(), memory_dir,
            lambda: memory_checkpoint.signature(self._ckpt, dtensor.num_clients()))
        self.restored_input = None  # the folder of the input position the latest restore belongs with, if not storage's
        self.saved_step = None  # the step of the latest storage save

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
        self._checked = None
        read_base(self.state, self._mesh)
        problem = mismatch(self._ckpt, path)
        if problem:
            raise UserError(f"checkpoint {path} is not of this model: {problem}; {fix}")
        try:
            with self._mesh():
                self._ckpt.restore(path).assert_existing_objects_matched()
            self.state.after_restore()  # pipeline stages' variables, read through the first stage
        except (AssertionError, ValueError) as e:
            raise UserError(f"checkpoint {path} is not of this model ({first_line(e)}); {fix}") from None

    def restore_weights(self, path: str, what: str, absent_ok=None) -> None:
        """Only the model's weights of checkpoint `path` (not the optimizer state or the step);
        `absent_ok(key)`: this model's weights the checkpoint may lack (they keep their values).

        Raises:
          UserError: the checkpoint is of another model (`what` names the setting that gave it).
        """
        read_weights(dataclasses.replace(self.state, saved=None, base=None), path, f"{what}={path}",
                     "pass a checkpoint of the same model config", self._mesh, absent_ok)

    def restore_latest(self) -> int | None:
        """Restores the newest complete, readable checkpoint if there is one; returns its step or None.

        A damaged checkpoint (an index whose data shards are missing or mixed from two
        writes, `scan`) or one whose files fail to read (checksum mismatch, truncated) is
        moved aside to `ckpt-N.corrupt.*`, and one holding a NaN or Inf (tfpod writes none;
        an older version could) to `ckpt-N.nonfinite.*`, so that no later save writes over
        them, and the one before is used. Host 0 moves them; on a folder another live run
        holds (an evaluation beside training) they are left in place, with the warning.
        """
        complete, damaged = scan(self.directory)
        for step in damaged:
            self._set_aside(os.path.join(self.directory, f"ckpt-{step}"), "corrupt",
                            "is damaged (its data shards are missing or come from different writes)")
        latest = self._manager.latest_checkpoint
        if latest and not tf.io.gfile.exists(latest + ".index"):
            log.warning("the newest checkpoint the list names, %s, has no index (its write did not finish): "
                        "skipping it", latest)
        fix = "use the gin config it was trained with, or a new --model_dir"
        self.restored_input = None
        choice = self.memory.choose(complete[-1] if complete else None) if self.memory else None
        if choice is not None:
            self._restore(choice.prefix, fix)
            log.info("resumed from the in-memory snapshot of step %d (%s, %s); the newest storage checkpoint is %s",
                     choice.step, choice.how, os.path.dirname(choice.prefix), self.latest or "none")
            self.restored_input = choice.input_dir
            return int(self._step.numpy())
        for step in reversed(complete):
            path = os.path.join(self.directory, f"ckpt-{step}")
            try:
                verify(path)
            except NonfiniteCheckpoint as e:  # written by an older tfpod, or by hand: never resumed from
                self._set_aside(path, "nonfinite", f"holds non-finite values ({e})")
                continue
            except (tf.errors.OpError, RuntimeError, IndexError) as e:  # every host finds the same files corrupt
                # (IndexError: a data file cut short, "Read less bytes than requested")
                self._set_aside(path, "corrupt", f"is corrupt ({first_line(e)})")
                continue
            self._restore(path, fix)
            restored = int(self._step.numpy())
            log.info("resumed from %s at step %d", path, restored)
            return restored
        if not complete and not damaged:
            return None
        raise UserError(f"every checkpoint in {self.directory} is damaged, corrupt or non-finite (moved aside as "
                        "*.corrupt.* or *.nonfinite.*): restore the folder from a backup, or start a new --model_dir")

    def _set_aside(self, path: str, kind: str, why: str) -> None:
        """Moves a checkpoint that cannot be resumed from aside (host 0), with one warning."""
        holder = run_folder.live_holder(os.path.dirname(self.directory))
        if holder is not None:
            log.warning("checkpoint %s %s: left in place, as a live run holds this folder (%s); trying the one "
                        "before it", path, why, run_folder.describe(holder))
            return
        moved = quarantine(path, kind) if dtensor.client_id() == 0 else f"*.{kind}.* by host 0"
        log.warning("checkpoint %s %s: moved it to %s; trying the one before it", path, why, moved)

    def check_finite(self) -> None:
        """Copies this host's shards of the state off the devices (what `save` writes) and
        raises NonfiniteState when any weight or optimizer slot holds a NaN or Inf.

        Every host checks its own shards and the hosts agree (`mesh.any_host`), so all raise or
        none does. The copy is kept for the `save` of the same step.
        """
        self.wait()  # a background write first frees its copy
        step = int(self._step.numpy())
        started = time.time()
        entries = self._writer.snapshot()
        copied = time.time() - started
        bad = self._nonfinite(entries)
        if bad is not None:
            self._checked = None
            raise NonfiniteState(step, bad or ["(on another host)"], self.latest)
        self._checked = (step, entries, copied)

    def _nonfinite(self, entries) -> list[str] | None:
        """The variables among this host's host copies `entries` that hold a NaN or Inf, or None
        when no host's do (the hosts agree, `mesh.any_host`: all see a finding or none does)."""
        bad = sorted({key.split("/.ATTRIBUTES")[0] for key, _, value in entries
                      if value.dtype.is_floating and not np.isfinite(value.numpy()).all()})
        found = bool(bad) if dtensor.num_clients() == 1 else meshlib.any_host(bool(bad), self._step_mesh)
        return bad if found else None

    def snapshot(self, write_input) -> float:
        """Writes this host's in-memory snapshot of the current step (`write_input(folder, step)`:
        its input position) unless the state holds a NaN or Inf; returns the seconds it took."""
        started, step = time.time(), int(self._step.numpy())
        entries, graph = self._writer.local_snapshot()
        if self._nonfinite(entries) is not None:
            log.warning("no in-memory snapshot of step %d: the state holds NaN or Inf", step)
            return time.time() - started
        size = self.memory.save(step, entries, graph, write_input)
        if size is not None:
            log.info("in-memory snapshot of step %d: %s in %.2f s", step, report.human_bytes(size),
                     time.time() - started)
        return time.time() - started

    def save(self, checked: bool = False) -> str:
        """Writes a checkpoint of the current step, never of non-finite state (NonfiniteState).

        Each host copies its shards off the devices and tfpod.checkpoint_writer writes
        them; the save returns when the checkpoint is whole. With `async_save` the write
        goes on in a background thread while training goes on; the next save (and `wait`)
        first waits for it.

        Args:
          checked: the caller ran `check_finite` at this step (its copy is written).
        """
        step = int(self._step.numpy())
        if not checked or self._checked is None or self._checked[0] != step:
            self.check_finite()
        (_, entries, copied), self._checked = self._checked, None
        self.wait()
        started = time.time()
        try:
            # The count of saves, as tf.train.CheckpointManager's save counts, outside the mesh: it
            # is a plain variable on this host's CPU, and under a default mesh each of the mesh's
            # devices added its own 1 to it, racing (a save counted 6 to 8, and its copy could
            # read the count before the last of them).
            path = os.path.join(self.directory, f"ckpt-{step}")
            self.saved_step = step
            if self.fault:
                self.fault(step, path, written=False)
            self._ckpt.save_counter.assign_add(1)
            counter = self._writer.copy({SAVE_COUNTER: self._ckpt.save_counter})
            with self._mesh():
                entries = [e for e in entries if e[0] != SAVE_COUNTER] + counter
                held = self._writer.start(path, lambda p: compat.record_checkpoint(self._manager, p), entries)
                del entries
                if not self._async:
                    self._writer.wait()
        except (tf.errors.OpError, OSError, checkpoint_writer.WriteFailed) as e:  # a full disk, a quota, a lost mount
            self._failed(step, e)
        if self._async:
            self._writing = (step, path, started)
            log.info("writing checkpoint %s in the background (this host's %s copied off the devices in %.2f s)",
                     path, report.human_bytes(held), copied)
        else:
            log.info("saved checkpoint %s", path)
            self._whole(step)
            if self.fault:
                self.fault(step, path, written=True)
        return path

    def _whole(self, step: int) -> None:
        """A storage checkpoint of `step` is whole: in-memory snapshots of it and before are of no more use."""
        if self.memory is not None:
            self.memory.prune(step)

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
        self._whole(step)

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


def read_weights(state: TrainState, path: str, where: str, fix: str, scope=contextlib.nullcontext,
                 absent_ok=None) -> None:
    """Reads only the state's model weights from checkpoint `path` (its optimizer state is
    left), within `scope` (e.g. the default mesh a DTensor restore names its files on).
    `absent_ok(key)`: the model's weights (checkpoint keys) the checkpoint may lack, e.g.
    LoRA's adapters on a base model's checkpoint; they keep their values.

    Raises:
      UserError: "`where` is not of this model" (the variables that differ) or does not fit
        it, then `fix`.
    """
    read_base(state, scope)
    ckpt = tf.train.Checkpoint(model=state.trackables()["model"])
    problem = mismatch(ckpt, path, weights_only=True, absent_ok=absent_ok)
    if problem:
        raise UserError(f"{where} is not of this model: {problem}; {fix}")
    try:
        with scope():
            status = ckpt.restore(path)
            if absent_ok is None:
                status.assert_existing_objects_matched()
            else:  # every weight but those it may lack got a value
                bound = {id(o) for o in compat.bound_objects(status)}
                unbound = [k for k, v in variables_by_key(ckpt).items() if id(v) not in bound and not absent_ok(k)]
                if unbound:
                    raise AssertionError(f"{len(unbound)} weight(s) got no value from it ({', '.join(unbound[:3])})")
    except (AssertionError, ValueError) as e:
        raise UserError(f"{where} does not fit this model ({first_line(e)}): {fix}") from None
    status.expect_partial()  # the optimizer's state is not read
    state.after_restore()  # pipeline stages' variables, read through the first stage


def read_base(state: TrainState, scope=contextlib.nullcontext) -> None:
    """Reads `state.base` (if any: a LoRA run's base checkpoint) into every weight of the model
    but the adapters, the part of the weights a checkpoint of `state` leaves out."""
    if state.base is not None:
        read_weights(dataclasses.replace(state, saved=None, base=None), state.base, f"the base {state.base} ({lora.BASE_FILE})",
                     "put back the base this run was trained on, or start a new --model_dir", scope,
                     lora.is_adapter_key)


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
      IndexError: a data file is shorter than its index says (TensorFlow's reader).
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


def mismatch(ckpt: tf.train.Checkpoint, path: str, show: int = 3, weights_only: bool = False,
             absent_ok=None) -> str | None:
    """What differs between the variables in checkpoint `path` and those `ckpt` holds (None: they match).

    Names up to `show` variables of each kind: missing from the checkpoint, in the
    checkpoint but not in the model, and stored with another shape. With `weights_only`,
    the checkpoint's optimizer state is not counted as extra (`ckpt` holds only `model`);
    keys for which `absent_ok(key)` holds are not counted as missing.
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
    missing = [short(k) for k in sorted(expected.keys() - stored.keys(), key=order)
               if not (absent_ok and absent_ok(k))]
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
