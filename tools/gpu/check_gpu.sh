#!/usr/bin/env bash
# The quick GPU check on a bare, offline node, from wheels and a data bundle, in at most ~10 minutes
# (docs/gpu_check.md).
#
#   bash tools/gpu/check_gpu.sh WHEELS_DIR BUNDLE OUT [extra tools/gpu_check.py arguments]
#
# WHEELS_DIR  the wheels of tools/fetch_wheels.py (installed into /tmp/site); '-' installs nothing
# BUNDLE      a data bundle of tools/build_data_bundle.py (BUNDLE.sha256 beside it): the users' command's data
# OUT         receives log.txt (everything printed), gpu_tests.txt, gpu_check.md/.json, users_command_log.txt,
#             users_command_metrics.jsonl, users_command_profile_* (its profiled step: tables, summary, trace)
#             and results_board.md (this check's results board row)
#
# Phases, each under its own timeout so that a cut run keeps what the earlier ones measured:
#   P0  wheels, versions, the bundle checked against its sha256 and unpacked (megatron_lite.bench.users_command),
#       then the GPU tests of tests/test_cuda_path.py (no host sync, bf16 rotation, CUDA graphs in the training
#       loop) into OUT/gpu_tests.txt, under GPU_CHECK_TESTS_S seconds (default 120; 0 skips them)
#   P1  tools/gpu_check.py --quick (env, parity, memory, throughput, users_command, sync) with the users'
#       command on the bundle's shards; the extra arguments go to it (e.g. --schemes rope,coca_slack,coca_strict)
#   P2  the results board row in OUT/results_board.md, also for a check that P1's timeout cut short
# Environment: PYTHON (python3), GPU_CHECK_WORK (/tmp/gpu_check: scratch), GPU_NODE_SITE (/tmp/site),
# GPU_CHECK_BUDGET (560: seconds for the whole job; P1 gets what P0 left, less 30 s for P2),
# GPU_CHECK_PACK (unset; 1: OUT's files packed at the end into OUT/results.tar.xz, the profiler's traces left
# beside it one file each, for a job that brings back only a few files: tools/gpu/pack_results.sh).
set -u -o pipefail

USAGE="bash tools/gpu/check_gpu.sh WHEELS_DIR BUNDLE OUT [extra tools/gpu_check.py arguments]"
# shellcheck source=tools/gpu/setup_offline_node.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_offline_node.sh"
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
BUDGET=${GPU_CHECK_BUDGET:-560}
echo "[t=$(el)] budget ${BUDGET} s"
mkdir -p "$WORK"

# P0: wheels, versions (setup_offline_node.sh), data
DATA_ARGS=$(timeout 180 "$PY" -m megatron_lite.bench.users_command "$BUNDLE" "$WORK/data")
if [ $? -ne 0 ] || [ -z "$DATA_ARGS" ]; then
  echo "[t=$(el)] the bundle did not unpack: the users_command section will be a skipped row"
  DATA_ARGS=""
fi
TESTS_S=${GPU_CHECK_TESTS_S:-120}
if [ "$TESTS_S" -gt 0 ]; then
  timeout -k 10 "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_path.py \
    > "$OUT/gpu_tests.txt" 2>&1
  echo "[t=$(el)] GPU tests exited $? (timeout ${TESTS_S} s): $(tail -n 1 "$OUT/gpu_tests.txt")"
fi
echo "[t=$(el)] P0 done: users_command data: ${DATA_ARGS:-none}"

# P1: the quick check (a fresh OUT: --force), the board row written by it when it finishes
CHECK_S=$(( BUDGET - $(el) - 30 ))
if [ "$CHECK_S" -lt 60 ]; then
  echo "error: only ${CHECK_S} s left of the ${BUDGET} s budget for the check"; exit 1
fi
BOARD="$OUT/results_board.md"
rm -f "$WORK/check/gpu_check.json" "$WORK/check/gpu_check.md"  # nothing of an earlier check reaches the board
# shellcheck disable=SC2086  # DATA_ARGS: --mix PATH --tokenizer PATH --vocab-size N, paths under $WORK
timeout -k 30 "$CHECK_S" "$PY" tools/gpu_check.py --quick --force --out "$WORK/check" --board "$BOARD" \
  $DATA_ARGS "$@"
CHECK_RC=$?
echo "[t=$(el)] P1 done: gpu_check exited $CHECK_RC (timeout ${CHECK_S} s)"

# P2: what the check wrote, into OUT; the board row from OUT's finished sections if the check did not finish
for name in gpu_check.json gpu_check.md; do
  [ -f "$WORK/check/$name" ] && cp "$WORK/check/$name" "$OUT/$name"
done
# the users' command: each run's log, metrics and profiled step (run/, or run_micro_batch_N/ with
# --users-micro-batch), named users_command[_micro_batch_N]_...
for log in "$WORK"/check/users_command/log*.txt; do
  [ -f "$log" ] && cp "$log" "$OUT/users_command_$(basename "$log")"
done
for run in "$WORK"/check/users_command/run*; do
  [ -d "$run" ] || continue
  suffix=${run##*/run}
  [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$OUT/users_command${suffix}_metrics.jsonl"
  for profiled in "$run"/profile/steps_*; do
    [ -f "$profiled" ] && cp "$profiled" "$OUT/users_command${suffix}_profile_$(basename "$profiled")"
  done
done
if [ "$CHECK_RC" -ne 0 ] && [ -f "$WORK/check/gpu_check.json" ]; then
  # shellcheck disable=SC2086
  timeout 60 "$PY" tools/gpu_check.py --quick --board-only --out "$WORK/check" --board "$BOARD" $DATA_ARGS "$@"
fi
echo "[t=$(el)] end: $OUT"
if [ "${GPU_CHECK_PACK:-}" = 1 ]; then
  exec >/dev/null 2>&1 && sleep 1  # the tee has then written the last of log.txt before it is packed
  bash "$REPO/tools/gpu/pack_results.sh" "$OUT"
fi
exit "$CHECK_RC"
