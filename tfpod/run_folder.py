"""The run folder: one writer at a time, and reading back what a run left there.

**One writer.** A run that writes a `model_dir` (train, train_and_eval, an import)
first takes it: host 0 creates `model_dir/claim.json` naming the job (a random id every
host of it shares), the machine, the process and the time, and refreshes it every
`HEARTBEAT_S` seconds while the run lives. A second run on a folder a live run holds is
refused with one line naming the holder. A claim whose holder is gone is stale and taken
over with one warning:

- on the same machine (same host name and boot): its process no longer exists (killed,
  or its id now belongs to another process);
- on another machine (a shared filesystem): it was not refreshed for `stale_after()`
  seconds (`TFPOD_CLAIM_STALE_S`, default 60).

The claim is made with `os.link` of a finished file (atomic on local disks and NFS) and
taken over by renaming the stale file away (only one taker's rename succeeds). The
heartbeat checks the file still names this job before refreshing it: a run whose claim
another run took over (it stalled past the stale time) stops at its next checkpoint
(`check_held`) instead of writing beside the new holder.

**Reading back.** `read_json` reads a JSON file of a run folder (plan.json,
goodput.json, an input position's source.json) and turns damage into one line naming
the file and what to do; `move_aside` renames a damaged file to `<name>.corrupt.<n>`
so nothing later writes over it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from typing import Callable

from tfpod import UserError

log = logging.getLogger("tfpod")

FILE = "claim.json"
HEARTBEAT_S = 10.0
_HELD: dict[str, "Claim"] = {}  # realpath of model_dir -> this process's claim on it


def stale_after() -> float:
    """Seconds without a heartbeat after which another machine's claim is stale."""
    raw = os.environ.get("TFPOD_CLAIM_STALE_S", "60")
    try:
        value = float(raw)
    except ValueError:
        raise UserError(f"TFPOD_CLAIM_STALE_S={raw!r} is not a number of seconds (default 60)") from None
    if value <= HEARTBEAT_S:
        raise UserError(f"TFPOD_CLAIM_STALE_S={raw} must exceed the claim's heartbeat of {HEARTBEAT_S:g} s")
    return value


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (None: no such process, or unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive_here(holder: dict) -> bool:
    """Whether a claim made on this machine (this boot) still has its process."""
    pid = int(holder.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    started = _process_start(pid)
    return started is None or holder.get("pid_start") in (None, started)


def describe(holder: dict, now: float | None = None) -> str:
    """The holder of a claim in words: host h of H (process P on machine M, `command`), since when, last seen."""
    now = time.time() if now is None else now
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", now)))
    command = holder.get("command", "")
    command = command if len(command) <= 80 else command[:77] + "..."
    return (f"job {holder.get('job', '?')}, host 0 of {holder.get('hosts', '?')} (process {holder.get('pid', '?')} on "
            f"machine {holder.get('machine', '?')}{', `' + command + '`' if command else ''}), since {since}, "
            f"last seen {max(0.0, now - holder.get('beat', now)):.0f} s ago")


class Claim:
    """This job's hold on a run folder (host 0 owns the file; every host keeps the object)."""

    def __init__(self, model_dir: str, holder: dict, owner: bool):
        self.model_dir, self.holder, self.owner = model_dir, holder, owner
        self.path = os.path.join(model_dir, FILE)
        self.lost: str | None = None  # who took the folder over, when another run did
        self._stop = threading.Event()
        self._thread = None
        if owner:
            self._thread = threading.Thread(target=self._beat, name="tfpod-claim", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            current = _read(self.path)
            if current is None or (current and current.get("job") != self.holder["job"]):  # {}: being replaced
                self.lost = describe(current) if current else "nobody (claim.json was removed)"
                log.error("%s: another run took over this folder (%s); this run stops at its next checkpoint",
                          self.path, self.lost)
                return
            self.holder["beat"] = time.time()
            try:
                _write(self.path, self.holder)
            except OSError as e:
                log.warning("%s could not be refreshed (%s): another run may take the folder over after %.0f s",
                            self.path, e, stale_after())

    def check(self) -> None:
        """Raises UserError when another run took the folder over (see the module docstring)."""
        if self.lost:
            raise UserError(f"{self.path}: another run took over --model_dir={self.model_dir} ({self.lost}) after this "
                            "one went unseen for longer than TFPOD_CLAIM_STALE_S: this run stops without writing "
                            "more; let the other run finish, or stop it and rerun this command to resume")

    def release(self) -> None:
        """Ends the claim (removes claim.json when it still names this job)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _HELD.pop(os.path.realpath(self.model_dir), None)
        if self.owner and not self.lost:
            current = _read(self.path)
            if current is not None and current.get("job") == self.holder["job"]:
                try:
                    os.remove(self.path)
                except OSError:
                    pass

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(path: str) -> dict | None:
    """A claim file's content (None: no file, or one being replaced)."""
    for _ in range(3):
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            time.sleep(0.05)
    return {}  # unreadable: treated as a claim whose holder is unknown (stale after the stale time)


def _write(path: str, holder: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(holder, f, indent=1)
    os.replace(tmp, path)


def _stale_reason(holder: dict, now: float) -> str | None:
    """Why a claim's holder is gone (None: it may be alive)."""
    if holder.get("machine") == socket.gethostname() and holder.get("boot") == _boot_id() and holder.get("pid"):
        return None if _alive_here(holder) else "its process is gone"
    if holder.get("machine") == socket.gethostname() and holder.get("boot") and holder.get("boot") != _boot_id():
        return "its machine restarted since"
    age = now - float(holder.get("beat", 0) or 0)
    return f"not refreshed for {age:.0f} s" if age > stale_after() else None


def _take(model_dir: str, holder: dict) -> None:
    """Creates claim.json for `holder`, taking a stale one over; UserError when a live run holds it."""
    path = os.path.join(model_dir, FILE)
    tmp = f"{path}.new-{holder['job']}"
    _write(tmp, holder)
    try:
        for _ in range(20):
            try:
                os.link(tmp, path)  # fails when the file exists: atomic, also on NFS
                return
            except FileExistsError:
                pass
            current = _read(path)
            if current is None:
                continue  # released meanwhile
            why = _stale_reason(current, time.time())
            if why is None:
                raise UserError(f"--model_dir={model_dir} is in use by another run ({describe(current)}): wait for "
                                f"it to end or stop it, or pass another --model_dir (its claim: {path})")
            moved = f"{path}.stale-{holder['job']}"
            try:
                os.rename(path, moved)  # only one taker's rename succeeds
            except FileNotFoundError:
                continue
            if _read(moved) != current:  # refreshed between the read and the rename: put it back
                try:
                    os.link(moved, path)
                finally:
                    os.remove(moved)
                continue
            os.remove(moved)
            log.warning("--model_dir=%s was claimed by a run that is gone (%s: %s): taking it over", model_dir,
                        describe(current) if current else "an unreadable claim.json", why)
        raise UserError(f"--model_dir={model_dir}: could not claim it ({path} kept changing): is another run "
                        "starting there? Wait for it, or pass another --model_dir")
    finally:
        try:
            os.remove(tmp)
        except OSError:
            pass


def take(model_dir: str, client_id: int = 0, num_clients: int = 1,
         agree: Callable[[list[float]], list[float]] | None = None) -> Claim:
    """Takes `model_dir` for this job before anything is written there.

    Host 0 makes the claim; with several hosts, `agree` (the max over hosts of a few
    numbers, a collective) shares the job id and the outcome, so every host of a
    refused job stops with the same line and every host of a running one knows its job.
    A process that already holds the folder gets its claim back.

    Raises:
      UserError: a live run holds the folder (host 0's line names it).
    """
    key = os.path.realpath(model_dir)
    if key in _HELD:
        return _HELD[key]
    job = secrets.randbelow(1 << 24)  # shared through a float32 collective: exact below 2**24
    holder = {"job": f"{job:06x}", "hosts": num_clients, "machine": socket.gethostname(), "boot": _boot_id(),
              "pid": os.getpid(), "pid_start": _process_start(os.getpid()), "since": time.time(),
              "beat": time.time(), "command": " ".join(os.path.basename(a) if i == 0 else a
                                                       for i, a in enumerate(sys.argv))}
    problem = None
    if client_id == 0:
        try:
            _take(model_dir, holder)
        except UserError as e:
            problem = e
        except OSError as e:  # told to every host below, so none waits for the others
            problem = UserError(f"--model_dir={model_dir}: its claim ({FILE}) cannot be written ({e.strerror or e}): "
                                "pass a folder this process may write")
    if num_clients > 1 and agree is not None:
        refused, shared = agree([1.0 if problem else 0.0, float(job) if client_id == 0 else 0.0])
        if refused and problem is None:
            problem = UserError(f"--model_dir={model_dir} is in use by another run (host 0 names it): wait for it to "
                                "end or stop it, or pass another --model_dir")
        holder["job"] = f"{int(shared):06x}"
    if problem is not None:
        raise problem
    claim = Claim(model_dir, holder, owner=client_id == 0)
    if client_id != 0:
        _check_shared(claim)
    _HELD[key] = claim
    return claim


def _check_shared(claim: Claim, wait_s: float = 10.0) -> None:
    """A host other than 0 checks it sees host 0's claim: the folder must be storage every host reaches."""
    deadline = time.time() + wait_s
    while time.time() < deadline:
        current = _read(claim.path)
        if current and current.get("job") == claim.holder["job"]:
            return
        time.sleep(0.2)
    log.warning("%s: this host does not see host 0's claim of job %s: --model_dir must be storage every host "
                "reaches (a shared filesystem), or the hosts write different folders", claim.path, claim.holder["job"])


def check_held(model_dir: str) -> None:
    """Raises UserError when this process's claim on `model_dir` was taken over (no claim: nothing to check)."""
    claim = _HELD.get(os.path.realpath(model_dir))
    if claim is not None:
        claim.check()


def live_holder(model_dir: str) -> dict | None:
    """The live claim of another process on `model_dir` (None: none, or this process holds it)."""
    if os.path.realpath(model_dir) in _HELD:
        return None
    current = _read(os.path.join(model_dir, FILE))
    if not current or _stale_reason(current, time.time()) is not None:
        return None
    return current


def move_aside(path: str) -> str:
    """Renames a damaged file to `<path>.corrupt.<n>` (the first free n); returns the new path."""
    n = 0
    while os.path.exists(f"{path}.corrupt.{n}"):
        n += 1
    os.rename(path, f"{path}.corrupt.{n}")
    return f"{path}.corrupt.{n}"


def read_json(path: str, what: str, fix: str):
    """The JSON content of a file tfpod wrote in a run folder (None: no such file).

    Raises:
      UserError: the file is damaged (not JSON, or unreadable): names it, `what` it holds,
        and `fix`.
    """
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is damaged ({_first_line(e)}): it holds {what}; {fix}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
