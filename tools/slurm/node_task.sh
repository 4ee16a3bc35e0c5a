#!/bin/bash
# One node's task of tools/slurm/train.sbatch: runs the launcher given as arguments (deepspeed ... train.py ...)
# and stays until the run has saved, then exits with the run's own code.
#
# Why a task of its own: SLURM's stop (the --signal warning, preemption) sends SIGTERM to every process of
# the step, and once the step's main task has exited it SIGKILLs whatever is left. The deepspeed launcher dies
# of SIGTERM at once while its ranks are still saving; as the main task it would end the step and get them
# killed mid-save. This task outlives the signal instead, waits for the launcher, and when a signal came,
# waits for the run dir's lock (rank 0 releases it after the final save, once every rank's files are written)
# with `python -m megatron_lite.training.run_lock`, whose exit code is the run's: 143 after a SIGTERM, and
# 143 only when the newest step dir is complete.
#
# A second SIGTERM (scancel after the time limit's warning, SLURM signalling the step again) never ends the wait
# early: this shell traps it, the ranks note it and finish their save, and run_lock starts with SIGTERM
# ignored (no window before its own handler is in place) and keeps waiting. Only SLURM's SIGKILL after KillWait
# cuts the save short, and then the run's code is not 143 and the job is not requeued.
#
# From the environment: RUN_DIR (the run dir train.py writes), RUN_LOCK_TIMEOUT (seconds to wait for the
# save after a signal, default 600).
set -uo pipefail

signalled=""
trap 'signalled=${signalled:-yes}' TERM INT  # a trapped signal interrupts `wait`, and this shell lives on

"$@" &
launcher=$!
wait "$launcher"
code=$?
while kill -0 "$launcher" 2>/dev/null; do  # the wait above was cut short by a signal: the launcher still runs
    wait "$launcher"
    code=$?
done
if [ -n "$signalled" ]; then
    echo "megatron_lite: node ${SLURM_NODEID:-0}: signalled; the launcher exited $code; waiting for the run in" \
        "$RUN_DIR to save"
    (trap '' TERM; exec python -m megatron_lite.training.run_lock "$RUN_DIR" --timeout "${RUN_LOCK_TIMEOUT:-600}")
    code=$?
fi
exit "$code"
