#!/usr/bin/env bash
# The gpu-speedrun pair (RoPE and CoCA slack, with the in-training extrapolation curve) on a bare, offline node,
# in one job of at most ~10 minutes (docs/gpu_check.md; the profile: docs/reproduction.md, "Profile gpu-speedrun").
#
#   bash tools/gpu/speedrun_pair.sh WHEELS_DIR BUNDLE OUT [extra tools/reproduce.py arguments]
#
# WHEELS_DIR  the wheels of tools/fetch_wheels.py (installed into /tmp/site); '-' installs nothing
# BUNDLE      a data bundle of tools/build_data_bundle.py (BUNDLE.sha256 beside it)
# OUT         receives what is small enough to bring back, no checkpoints: log.txt (everything printed),
#             results.json, tables.md, probe.json, wall_times.json, the plots, <scheme>_metrics.jsonl (the
#             curve is in them), <scheme>_extrapolation.png, <scheme>_train_log_tail.txt, results_board.md, and
#             with `--set train.profile.start_step=N` (train.py's profiler) <scheme>_profile_steps_* (table, trace)
#
# Phases, each under its own timeout, so that a cut run keeps what the earlier ones did:
#   P0  wheels, versions
#   P1  reproduce.py --only data,probe: the bundle unpacked and checked, the probe; the training budget is what
#       the job has left after it (SPEEDRUN_TRAIN_EVAL_S, default: the budget less the time spent so far,
#       the probe's estimate and 40 s for copying), fixed now because the probe turns it into the step count
#   P2  reproduce.py --only train,eval,report under the time left; a SIGTERM at the limit makes train.py save
#   P3  the small outputs into OUT (also after a cut P2: the metrics rows and curve so far)
# Environment: PYTHON (python3), SPEEDRUN_WORK (/tmp/speedrun: scratch, the run's OUT), GPU_NODE_SITE
# (/tmp/site), SPEEDRUN_BUDGET (570: seconds for the whole job), SPEEDRUN_PROBE_S (120: the probe's estimate).
set -u -o pipefail

USAGE="bash tools/gpu/speedrun_pair.sh WHEELS_DIR BUNDLE OUT [extra tools/reproduce.py arguments]"
# shellcheck source=tools/gpu/setup_offline_node.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_offline_node.sh"  # P0: wheels, versions
WORK=${SPEEDRUN_WORK:-/tmp/speedrun}
BUDGET=${SPEEDRUN_BUDGET:-570}
PROBE_S=${SPEEDRUN_PROBE_S:-120}
echo "[t=$(el)] budget ${BUDGET} s"
echo "[t=$(el)] P0 done"

# P1: data and probe, with the training budget the job can still give
TRAIN_EVAL_S=${SPEEDRUN_TRAIN_EVAL_S:-$(( BUDGET - $(el) - PROBE_S - 40 ))}
if [ "$TRAIN_EVAL_S" -lt 120 ]; then
  echo "error: only ${TRAIN_EVAL_S} s left of the ${BUDGET} s budget for training and evaluation"; exit 1
fi
COMMON=(tools/reproduce.py --profile gpu-speedrun --bundle "$BUNDLE" --out "$WORK" --board "$OUT/results_board.md"
        --budget-seconds "$TRAIN_EVAL_S")
timeout -k 20 $(( PROBE_S + 60 )) "$PY" "${COMMON[@]}" --only data,probe "$@"
PROBE_RC=$?
echo "[t=$(el)] P1 done: data + probe exited $PROBE_RC (training + evaluation budget ${TRAIN_EVAL_S} s)"

# P2: train, evaluate, report in what is left (SIGTERM first: train.py saves, a rerun of this script resumes)
RC=$PROBE_RC
if [ "$PROBE_RC" -eq 0 ]; then
  LEFT=$(( BUDGET - $(el) - 30 ))
  timeout -s TERM -k 20 "$LEFT" "$PY" "${COMMON[@]}" --only train,eval,report "$@"
  RC=$?
  echo "[t=$(el)] P2 done: train + eval + report exited $RC (timeout ${LEFT} s)"
fi

# P3: the small outputs
for name in results.json tables.md probe.json wall_times.json; do
  [ -f "$WORK/$name" ] && cp "$WORK/$name" "$OUT/$name"
done
cp "$WORK"/*.png "$OUT/" 2>/dev/null
for run in "$WORK"/runs/*/; do
  scheme=$(basename "$run")
  [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$OUT/${scheme}_metrics.jsonl"
  [ -f "$run/extrapolation.png" ] && cp "$run/extrapolation.png" "$OUT/${scheme}_extrapolation.png"
  for profiled in "$run"/profile/steps_*; do  # with --set train.profile.start_step=N: the profiled steps
    [ -f "$profiled" ] && cp "$profiled" "$OUT/${scheme}_profile_$(basename "$profiled")"
  done
  [ -f "$WORK/logs/train_$scheme.log" ] && tail -c 20000 "$WORK/logs/train_$scheme.log" \
    > "$OUT/${scheme}_train_log_tail.txt"
done
echo "[t=$(el)] end: $OUT"
exit "$RC"
