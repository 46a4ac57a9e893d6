"""What the bench scripts share: one measurement in a fresh process, its JSON result back.

Every bench script runs each measurement as `python <script> --worker=...` in its own
process (a fresh TensorFlow runtime, nothing sharing the cores) and reads the last
JSON line the worker prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def run_worker(cmd: list[str], tag: str, name: str, cwd: str, verbose: bool = False,
               timeout: float | None = None) -> dict:
    """Runs `cmd` (a worker process) and returns its last JSON line, with its wall time.

    Args:
      cmd: the worker's command line.
      tag, name: the script's and the measurement's names, for the progress lines.
      cwd: the working directory (the checkout).
      verbose: pass the worker's stderr through.
      timeout: seconds before the worker is stopped.

    Returns:
      The worker's result with "process_wall_s", or {"error": its last line of output}.
    """
    print(f"[{tag}] {name} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, text=True, stdout=subprocess.PIPE,
                              stderr=None if verbose else subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()
        error = tail[-1] if tail else f"exit status {proc.returncode}"
        print(f"[{tag}] {name}: failed: {error}", file=sys.stderr, flush=True)
        return {"error": error}
    result = json.loads(lines[-1])
    result["process_wall_s"] = time.perf_counter() - t
    return result


def rotate(names: list[str], all_runs, repeats: int, run, error) -> dict[str, list[dict]]:
    """Each of `names` run `repeats` times in rotation (a slow spell of the machine hits every
    run alike): {name: [result, ...]}. `error(message)` reports an unknown name (argparse's)."""
    unknown = [n for n in names if n not in all_runs]
    if unknown:
        error(f"--runs: unknown {','.join(unknown)}; use a subset of {','.join(all_runs)}")
    trials = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            trials[name].append(run(name))
    return trials


def best(results: list[dict], rate: str) -> dict:
    """The repeat with the highest `rate` (a result key), with every repeat's rate as "repeats_<rate>"."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[-1]
    top = dict(max(ok, key=lambda r: r[rate]))
    top[f"repeats_{rate}"] = [r.get(rate) for r in results]
    return top
