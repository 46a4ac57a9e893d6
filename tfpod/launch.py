"""Local multi-host launcher: H processes on loopback, each a DTensor client.

    python -m tfpod.launch --num_hosts=2 --devices_per_host=4 -- python main.py --gin_file=... --model_dir=D

Starts one process per host with free loopback ports and the standard DTensor
environment (DTENSOR_CLIENT_ID, DTENSOR_NUM_CLIENTS, DTENSOR_JOB_NAME, DTENSOR_JOBS)
plus TFPOD_CPU_DEVICES (logical CPU devices per host). Every output line is prefixed
with `[host h]`. When any host exits non-zero, the others are killed (they cannot go on
without it; the last complete checkpoint is intact) and the launcher exits non-zero with
one line naming that host; with `--max_restarts=N` it instead starts every host again, up
to N times with a doubling backoff (`--restart_backoff_s`), and they resume from the newest
complete checkpoint (each host sees TFPOD_RESTART=k; goodput counts the restarts).
SIGTERM to the launcher (a preemption notice) is passed to every host: they finish the
current step, save a checkpoint and exit 0, and so does the launcher, never restarting. On a real cluster run the same command once per host with the same DTENSOR_*
variables (see README).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("localhost", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def host_env(host_id: int, num_hosts: int, ports: list[int], devices_per_host: int) -> dict:
    from tfpod import console

    env = console.child_env()  # each host's main.py picks its own TensorFlow log level
    env.update({
        "DTENSOR_CLIENT_ID": str(host_id),
        "DTENSOR_NUM_CLIENTS": str(num_hosts),
        "DTENSOR_JOB_NAME": "worker",
        "DTENSOR_JOBS": ",".join(f"localhost:{p}" for p in ports),
        "TFPOD_CPU_DEVICES": str(devices_per_host),
        "PYTHONUNBUFFERED": "1",
        "TFPOD_HOST_PREFIXED": "1",  # this launcher prefixes each line with its host: the host need not
    })
    return env


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _run_hosts(num_hosts: int, devices_per_host: int, command: list[str], out, restart: int, state: dict):
    """One start of every host; returns None (all exited 0) or (host, code) of the first failure
    ((None, 130): interrupted). `state["procs"]` holds the running hosts (for the SIGTERM handler)."""
    ports = free_ports(num_hosts)
    procs = state["procs"] = []
    for h in range(num_hosts):
        env = {**host_env(h, num_hosts, ports, devices_per_host), "TFPOD_RESTART": str(restart),
               "TFPOD_LAUNCH_TIME": f"{time.time():.3f}"}  # a restart's start-up counts from here (goodput)
        p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        threading.Thread(target=_pump, args=(p.stdout, f"[host {h}] ", out), daemon=True).start()
        procs.append(p)
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(h, c) for h, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        failed = (None, 130)
    if failed is not None:
        # The others wait in collectives for the lost host: they cannot save, so they are killed.
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
    time.sleep(0.2)  # let the output threads drain
    return failed


def launch(num_hosts: int, devices_per_host: int, command: list[str], out=sys.stdout, max_restarts: int = 0,
           backoff_s: float = 2.0, reset_s: float = 600.0) -> int:
    """Runs `command` as `num_hosts` local hosts; returns 0 or the last failure's code.

    After a host fails (exits non-zero or is killed), every host is stopped and, up to
    `max_restarts` times, all are started again (they resume from the newest complete
    checkpoint), after `backoff_s`, doubled at each restart in a row (at most 5 minutes); a
    start that ran `reset_s` or longer before failing counts as healthy, so the wait after it
    is `backoff_s` again (Kubernetes resets a pod's crash backoff so). A SIGTERM (preemption)
    is passed to every host and is never followed by a restart.
    """
    state = {"procs": [], "stopping": False}

    def forward(signum, frame):  # preemption: every host saves and exits 0
        del frame
        state["stopping"] = True
        print(f"launcher: {signal.Signals(signum).name}: passing it to every host", file=sys.stderr, flush=True)
        for p in state["procs"]:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:  # exited meanwhile
                    pass

    try:  # kept until the launcher returns: a repeated notice while the hosts exit is passed on, not fatal
        previous = signal.signal(signal.SIGTERM, forward)
    except ValueError:  # not the main thread: SIGTERM keeps its default action
        previous = None
    restarts = in_a_row = 0
    try:
        while True:
            started = time.time()
            failed = _run_hosts(num_hosts, devices_per_host, command, out, restarts, state)
            if failed is None or failed[0] is None or state["stopping"] or restarts >= max_restarts:
                break
            restarts += 1
            in_a_row = 0 if time.time() - started >= reset_s else in_a_row
            wait = min(backoff_s * 2 ** in_a_row, 300.0)
            in_a_row += 1
            print(f"launcher: host {failed[0]} {_describe(failed[1])}: starting every host again in {wait:g} s, "
                  f"from the newest complete checkpoint (restart {restarts} of --max_restarts={max_restarts})",
                  file=sys.stderr, flush=True)
            deadline = time.time() + wait
            while time.time() < deadline and not state["stopping"]:
                time.sleep(0.1)
            if state["stopping"]:
                break
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if failed is None:
        return 0
    host, code = failed
    if host is None:
        print("error: interrupted: stopped every host", file=sys.stderr)
        return 130
    tried = f" after {restarts} automatic restart(s)" if max_restarts else ""
    print(f"error: host {host} {_describe(code)}{tried}: stopped the other {num_hosts - 1} host(s); "
          f"the last complete checkpoint is intact, so rerunning the same command resumes from it", file=sys.stderr)
    return code if code > 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("error: give the command after --, e.g. python -m tfpod.launch --num_hosts=2 -- python main.py ...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m tfpod.launch", description="Run local hosts of a DTensor job.")
    parser.add_argument("--num_hosts", type=int, required=True)
    parser.add_argument("--devices_per_host", type=int, default=1, help="logical CPU devices per host")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="start every host again (from the newest complete checkpoint) after a host fails, "
                             "up to this many times; never after a SIGTERM")
    parser.add_argument("--restart_backoff_s", type=float, default=2.0,
                        help="seconds before the first restart, doubled at each one in a row (at most 300)")
    parser.add_argument("--restart_reset_s", type=float, default=600.0,
                        help="a start that ran this long before failing was healthy: the next wait is "
                             "--restart_backoff_s again")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if args.num_hosts < 1 or args.devices_per_host < 1 or not command:
        print("error: --num_hosts and --devices_per_host must be positive, and a command must follow --", file=sys.stderr)
        return 2
    if args.max_restarts < 0 or args.restart_backoff_s < 0 or args.restart_reset_s < 0:
        print(f"error: --max_restarts={args.max_restarts}, --restart_backoff_s={args.restart_backoff_s} and "
              f"--restart_reset_s={args.restart_reset_s} must be >= 0", file=sys.stderr)
        return 2
    return launch(args.num_hosts, args.devices_per_host, command, max_restarts=args.max_restarts,
                  backoff_s=args.restart_backoff_s, reset_s=args.restart_reset_s)


def console_main() -> None:
    """Entry point of the `tfpod-launch` console script."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
