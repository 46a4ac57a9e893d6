"""In-memory checkpoints: frequent snapshots of each host's own shards in local memory, and
one peer host's copy of them, so a restart after a crash reads no storage.

Every `train.memory_checkpoint_every` steps each host writes a snapshot to its local
memory (`train.memory_checkpoint_dir`, by default /dev/shm/tfpod: RAM that outlives the
process, not the machine):

    <dir>/<run>/host<h>/own/step-<N>/       this host's snapshot of step N
        state.index, state.data-00000-of-00001   every distinct shard on this host's devices
                                                 and the object graph (TensorFlow's format)
        input/                              this host's input position (tfpod.input_position)
        manifest.json                       step, hosts, the layouts' signature, each file's
                                            SHA-256; written last: a snapshot without it is partial
    <dir>/<run>/host<h>/copies/host<g>/step-<N>/   host g's snapshot, copied here (g = h - 1 mod H)

A snapshot is a checkpoint that this host alone restores from on the same mesh and layouts
(`tf.train.Checkpoint.restore` on each host reads its own folder: each device finds its
shards there). It is written whole to a temporary folder and renamed into place; the one
before is then deleted, so a host keeps one snapshot and one peer's copy (twice its own
shards of the state in memory). The copy goes to the peer over TCP (tfpod.peer_link) in a
background thread while training goes on. A storage checkpoint at step S makes snapshots
of S and before useless: they are deleted then, and at the end of training none is left.

On restore the hosts pick together, through the coordination service's key-value store:
the newest step N for which every host has its own snapshot or its peer holds a copy, if N
is newer than the newest complete storage checkpoint. A host without its own fetches its
copy from the peer (a host whose memory was lost, a replaced machine); the hosts confirm
every fetch before any restores, and fall back to storage together if one failed. The log
says which state was read. With one host there is no peer: a process crash still restores
from memory, a lost machine from storage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import tarfile
import tempfile
import threading
from typing import Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, compat, peer_link

log = logging.getLogger("tfpod")

STATE = "state"  # the snapshot's checkpoint prefix in its folder
INPUT = "input"
MANIFEST = "manifest.json"
KV_TIMEOUT_MS = 600_000
_INSTANCES = itertools.count()  # the process's managers, made in the same order on every host: their keys


def default_root() -> str:
    """/dev/shm/tfpod where /dev/shm exists (Linux), else a folder in the temporary directory."""
    return "/dev/shm/tfpod" if os.path.isdir("/dev/shm") else os.path.join(tempfile.gettempdir(), "tfpod-memory")


def run_key(model_dir: str) -> str:
    """The run's folder name under the memory root: its model_dir's name and a hash of its path."""
    path = os.path.abspath(model_dir)
    return f"{os.path.basename(path.rstrip(os.sep)) or 'run'}-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The state a restore reads: `prefix` (a checkpoint prefix) and `input_dir` of `step`; `how` in words."""

    step: int
    prefix: str
    input_dir: str
    how: str


class MemoryCheckpoints:
    """This host's snapshots and its peer's copies (see the module docstring).

    Args:
      model_dir: the run's folder (names the run's memory folder).
      host, hosts: this host and the number of hosts.
      root: the memory folder (train.memory_checkpoint_dir; None: `default_root`).
      signature: () -> the mesh and every variable's layout, hashed (`signature`): a snapshot of
        another is not read.
    """

    def __init__(self, model_dir: str, host: int, hosts: int, root: str | None, signature: Callable[[], str]):
        self.host, self.hosts, self._signature, self._signed = host, hosts, signature, None
        self.folder = os.path.join(root or default_root(), run_key(model_dir), f"host{host}")
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise UserError(f"train.memory_checkpoint_dir={root or default_root()!r}: cannot write there ({e}): set it "
                            "to a writable folder in local memory (or 0 train.memory_checkpoint_every)") from None
        self.own = os.path.join(self.folder, "own")
        self.copies = os.path.join(self.folder, "copies")
        self._lock = threading.Lock()
        self._sending: threading.Thread | None = None
        self._send_error: BaseException | None = None
        self._choices = 0  # restores so far: each agreement's keys are its own
        self._instance = next(_INSTANCES)
        self.peer = (host + 1) % hosts  # the host that keeps this host's copy
        self.link = None
        if hosts > 1:
            from tensorflow.python.eager import context

            self._kv = context.context()
            self.link = peer_link.PeerLink(host, hosts, self, self._kv, self._instance)

    def _sig(self) -> str:
        if self._signed is None:  # (the layouts are fixed for the run)
            self._signed = self._signature()
        return self._signed

    # -- writing -------------------------------------------------------------------------
    def save(self, step: int, entries: list, graph: bytes, write_input) -> int | None:
        """Writes this host's snapshot of `step` (`entries`: checkpoint_writer.local_snapshot's
        host copies; `write_input(folder, step)`: the input position) and starts sending it to
        the peer; returns the bytes written, or None when it could not be written (one warning:
        a full memory folder costs this snapshot, not the run; storage checkpoints go on)."""
        self.wait_sent()
        final, temp = os.path.join(self.own, f"step-{step}"), None
        try:
            os.makedirs(self.own, exist_ok=True)
            temp = tempfile.mkdtemp(prefix=f"step-{step}.tmp-", dir=self.own)
            entries = entries + [("_CHECKPOINTABLE_OBJECT_GRAPH", "", tf.constant(graph))]
            with tf.device(dtensor.local_devices("CPU")[0].to_string()):
                tf.raw_ops.SaveV2(prefix=os.path.join(temp, STATE), tensor_names=[k for k, _, _ in entries],
                                  shape_and_slices=[s for _, s, _ in entries], tensors=[t for _, _, t in entries])
            write_input(os.path.join(temp, INPUT), step)
            size = write_manifest(temp, {"step": step, "host": self.host, "hosts": self.hosts,
                                         "signature": self._sig()})
        except (OSError, tf.errors.OpError, UserError) as e:
            if temp:
                shutil.rmtree(temp, ignore_errors=True)
            log.warning("no in-memory snapshot of step %d: it could not be written to %s (%s); training goes on, "
                        "a restart reads storage or an older snapshot", step, self.own, str(e).splitlines()[0][:300])
            return None
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(temp, final)
        self._keep_only(self.own, step)
        if self.link is not None:
            self._sending = threading.Thread(target=self._send, args=(step, final), name="tfpod-snapshot-send",
                                             daemon=True)
            self._sending.start()
        return size

    def _send(self, step: int, folder: str) -> None:
        try:
            self.link.send(self.peer, step, folder)
        except Exception as e:  # noqa: BLE001 -- a thread's error, reported by the next save (one warning)
            self._send_error = e

    def wait_sent(self) -> None:
        """Waits for the copy being sent to the peer; a failed one is one warning (the snapshot
        is still this host's own; only the loss of this host would need the copy)."""
        if self._sending is not None:
            self._sending.join()
            self._sending = None
        if self._send_error is not None:
            log.warning("the in-memory snapshot's copy could not be sent to host %d (%s): a restart after losing "
                        "this host reads storage", self.peer, self._send_error)
            self._send_error = None

    def prune(self, step: int) -> None:
        """Deletes snapshots and copies of `step` and before (a storage checkpoint of `step` is written)."""
        with self._lock:
            for folder in [self.own] + [os.path.join(self.copies, d) for d in _listdir(self.copies)]:
                for s in _steps(folder):
                    if s <= step:
                        shutil.rmtree(os.path.join(folder, f"step-{s}"), ignore_errors=True)
            for folder in [os.path.join(self.copies, d) for d in _listdir(self.copies)] + [
                    self.own, self.copies, self.folder, os.path.dirname(self.folder)]:
                try:
                    os.rmdir(folder)  # only when empty: nothing is left in memory at the end of a run
                except OSError:
                    pass

    def close(self) -> None:
        self.wait_sent()
        if self.link is not None:
            self.link.close()

    @staticmethod
    def _keep_only(folder: str, step: int) -> None:
        """Deletes the snapshots in `folder` but that of `step`, and temporary folders left by a crash."""
        for name in _listdir(folder):
            if name != f"step-{step}":
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)

    # -- the peer's side (peer_link.Store) -------------------------------------------------
    def incoming(self, host: int, step: int) -> str:
        folder = os.path.join(self.copies, f"host{host}")
        os.makedirs(folder, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"step-{step}.tmp-", dir=folder)

    def received(self, host: int, step: int, folder: str) -> None:
        with self._lock:
            final = os.path.join(os.path.dirname(folder), f"step-{step}")
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(folder, final)
            self._keep_only(os.path.dirname(final), step)

    def copy_of(self, host: int, step: int) -> str | None:
        folder = os.path.join(self.copies, f"host{host}", f"step-{step}")
        return folder if check(folder, step, self._sig()) is None else None

    # -- restoring -----------------------------------------------------------------------
    def holdings(self) -> dict:
        """{"own": [steps of whole snapshots of this mesh], "copies": {host: [steps]}}."""
        mine = self._sig()
        own = [s for s in _steps(self.own) if check(os.path.join(self.own, f"step-{s}"), s, mine) is None]
        copies = {}
        for name in _listdir(self.copies):
            if name.startswith("host") and name[4:].isdigit():
                folder = os.path.join(self.copies, name)
                copies[int(name[4:])] = [s for s in _steps(folder) if self.copy_of(int(name[4:]), s)]
        return {"own": own, "copies": copies}

    def choose(self, storage_step: int | None) -> Choice | None:
        """The snapshot every host restores from (the same on all), or None: storage's newest is
        as new, or no step is whole across the hosts. Fetches this host's copy when it lacks its own."""
        self._choices += 1
        mine = self.holdings()
        every = self._exchange("holdings", json.dumps(mine))
        every = [json.loads(v) for v in every]
        step = newest_whole([(h["own"], {int(g): s for g, s in h["copies"].items()}) for h in every], self.hosts)
        held = max((s for h in every for s in h["own"] + [x for v in h["copies"].values() for x in v]), default=None)
        if held is not None and (step is None or held > step) and (storage_step is None or held > storage_step):
            log.warning("the in-memory snapshot of step %d is not held for every host (each host's own and its copy: "
                        "%s); reading %s", held, "; ".join(
                            f"host {h}: {v['own']}, copies {v['copies']}" for h, v in enumerate(every)),
                        f"the snapshot of step {step}" if step is not None and (storage_step is None or step > storage_step)
                        else "storage")
        if step is None or (storage_step is not None and step <= storage_step):
            if step is not None:
                self.prune(step)  # storage is as new: the snapshots are of no use
            return None
        folder, how = os.path.join(self.own, f"step-{step}"), "this host's own"
        ok = step in mine["own"]
        if not ok:  # this host lost its snapshot: its peer's copy serves
            how = f"its copy held by host {self.peer}"
            ok = self._fetch(step, folder)
        if self.hosts > 1 and not all(v == "ok" for v in self._exchange("fetched", "ok" if ok else "failed")):
            log.warning("the in-memory snapshot of step %d could not be gathered on every host: resuming from storage",
                        step)
            return None
        return Choice(step, os.path.join(folder, STATE), os.path.join(folder, INPUT), how)

    def _fetch(self, step: int, folder: str) -> bool:
        os.makedirs(self.own, exist_ok=True)
        temp = tempfile.mkdtemp(prefix=f"step-{step}.tmp-", dir=self.own)
        try:
            if self.link is None or not self.link.fetch(self.peer, self.host, step, temp):
                raise OSError(f"host {self.peer} holds no copy of it")
            problem = check(temp, step, self._sig())
            if problem:
                raise OSError(problem)
        except (OSError, ValueError, tarfile.TarError, tf.errors.OpError) as e:
            shutil.rmtree(temp, ignore_errors=True)
            log.warning("could not fetch this host's snapshot of step %d from host %d: %s", step, self.peer, e)
            return False
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.rename(temp, folder)
        return True

    def _exchange(self, what: str, value: str) -> list[str]:
        """Every host's `value` for this restore's `what` (this host's included), in host order."""
        if self.hosts == 1:
            return [value]
        key = f"tfpod/memory/{self._instance}/{self._choices}/{what}/" + "{}"
        self._kv.set_config_key_value(key.format(self.host), value)
        return [value if h == self.host else self._kv.get_config_key_value(key.format(h), KV_TIMEOUT_MS)
                for h in range(self.hosts)]


def newest_whole(holdings: list[tuple[list[int], dict[int, list[int]]]], hosts: int) -> int | None:
    """The newest step every host can restore: host g from its own snapshot or from the copy
    its peer (g + 1 mod hosts) holds. `holdings[h]`: (host h's own steps, {host: steps of its copies})."""
    def has(g: int, step: int) -> bool:
        return step in holdings[g][0] or step in holdings[(g + 1) % hosts][1].get(g, [])

    candidates = {s for own, copies in holdings for s in own + [x for v in copies.values() for x in v]}
    whole = [s for s in candidates if all(has(g, s) for g in range(hosts))]
    return max(whole) if whole else None


def signature(ckpt: tf.train.Checkpoint, hosts: int) -> str:
    """The hosts and every saved variable's layout (mesh included), hashed: a snapshot is read
    only on the same (each host holds its own devices' shards)."""
    parts = [f"hosts={hosts}"]
    for key, variable in sorted(compat.checkpoint_objects(ckpt).items()):
        layout = getattr(compat.inner_variable(variable), "layout", None)
        if layout is None:
            parts.append(f"{key} {variable.shape} plain")
            continue
        mesh = layout.mesh  # (its text names this host's local devices: the same on every host is wanted)
        parts.append(f"{key} {variable.shape} {layout.sharding_specs} {mesh.device_type()} "
                     f"{[(n, mesh.dim_size(n)) for n in mesh.dim_names]} {mesh.global_device_ids().tolist()}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def write_manifest(folder: str, record: dict) -> int:
    """Writes `folder`/manifest.json (the record and every file's SHA-256) last; returns the files' bytes."""
    files, size = {}, 0
    for path in sorted(_files(folder)):
        files[os.path.relpath(path, folder)] = _sha256(path)
        size += os.path.getsize(path)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({**record, "files": files}, f, indent=1, sort_keys=True)
    return size


def check(folder: str, step: int, signature_: str) -> str | None:
    """What is wrong with the snapshot in `folder` (None: whole, of `step`, of this mesh, every checksum right)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return "no manifest (a partial snapshot)"
    if record.get("step") != step or record.get("signature") != signature_:
        return "of another step, mesh or model"
    for name, digest in record.get("files", {}).items():
        path = os.path.join(folder, name)
        if not os.path.exists(path) or _sha256(path) != digest:
            return f"{name} is missing or damaged"
    return None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: str):
    for dirpath, _, names in os.walk(folder):
        for n in names:
            if n != MANIFEST or dirpath != folder:
                yield os.path.join(dirpath, n)


def _listdir(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _steps(folder: str) -> list[int]:
    return sorted(int(n[5:]) for n in _listdir(folder) if n.startswith("step-") and n[5:].isdigit())

