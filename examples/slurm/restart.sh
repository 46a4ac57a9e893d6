#!/bin/bash
# Runs a job step (srun ...) again after it fails, inside the same SLURM allocation:
#   exec bash examples/slurm/restart.sh srun --kill-on-bad-exit=1 python main.py ...
# up to TFPOD_MAX_RESTARTS times (default 3), after TFPOD_RESTART_BACKOFF_S seconds (default 10,
# doubled at each restart in a row; a start that ran TFPOD_RESTART_RESET_S seconds (default 600)
# before failing was healthy, and the wait after it is the first again); every start resumes from the newest complete checkpoint and sees
# TFPOD_RESTART=k (goodput counts the automatic restarts). A SIGTERM (a preemption, or
# sbatch's --signal before the time limit) is passed to the step, which saves and exits 0,
# and is never followed by a restart. Exits with the last start's status.
max=${TFPOD_MAX_RESTARTS:-3}
first=${TFPOD_RESTART_BACKOFF_S:-10}
reset=${TFPOD_RESTART_RESET_S:-600}
backoff=$first
stopping=0
step=
trap 'stopping=1; [ -n "$step" ] && kill -TERM "$step" 2>/dev/null' TERM
for ((k = 0; ; k++)); do
  started=$SECONDS
  TFPOD_RESTART=$k "$@" &
  step=$!
  wait "$step"; rc=$?
  while kill -0 "$step" 2>/dev/null; do wait "$step"; rc=$?; done  # (a trapped TERM ends a wait early)
  if [ "$rc" -eq 0 ] || [ "$stopping" -eq 1 ] || [ "$k" -ge "$max" ]; then
    exit "$rc"
  fi
  if [ $((SECONDS - started)) -ge "$reset" ]; then
    backoff=$first
  fi
  echo "restart.sh: the step exited with status $rc: starting it again in $backoff s, from the newest complete checkpoint (restart $((k + 1)) of TFPOD_MAX_RESTARTS=$max)" >&2
  step=
  sleep "$backoff" & wait $!  # (a TERM ends the wait)
  if [ "$stopping" -eq 1 ]; then
    exit "$rc"
  fi
  backoff=$((backoff * 2))
done
