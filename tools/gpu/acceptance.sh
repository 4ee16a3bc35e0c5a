#!/usr/bin/env bash
# The GPU acceptance run on one H100/H200 node, bare and offline, from wheels and data bundles (docs/gpu_check.md).
#
#   bash tools/gpu/acceptance.sh [--dry-run] WHEELS_DIR BUNDLE OUT [SPEEDRUN_BUNDLE]
#
# WHEELS_DIR       the wheels of tools/fetch_wheels.py (installed into /tmp/site); '-' installs nothing
# BUNDLE           a data bundle of tools/build_data_bundle.py (BUNDLE.sha256 beside it): the users' command's data
# OUT              receives everything below, then packed (tools/gpu/pack_results.sh) into OUT/results.tar.xz with
#                  the profiler's traces beside it
# SPEEDRUN_BUNDLE  the speedrun's bundle, >= 30M tokens so that the pair sees it at most ~3 times (default: BUNDLE)
# --dry-run        every phase on CPU with a tiny model (fp32) in a few minutes: checks the script, measures nothing
#
# Phases, in order, each bounded by its own deadline (its cap, or what the budget has left), so that a cut run
# keeps what the earlier phases measured; a phase with under 60 s left is skipped with a line saying so:
#   setup     wheels, versions, BUNDLE checked against its sha256 and unpacked (the users' mix, tokenizer, vocabulary)
#   default   the users' command as it runs by default on CUDA (deepspeed --num_gpus 1 train.py --config
#             configs/coca_350m.yml: bf16, compiled, CUDA graphs), shortened: E2E_ITERS steps, a validation and a
#             save every E2E_SAVE steps; killed (SIGKILL) once its first save is complete, resumed with --resume auto
#             to the end; an uninterrupted run of the same steps; the resumed losses against it (e2e_resume.md: the
#             max abs difference, printed, bf16 noise expected); the checkpoint converted to Hugging Face
#             (e2e_convert.txt); then the GPU tests of tests/test_cuda_path.py (gpu_tests.txt)
#   vocab     the users' command at the paper's vocabulary (model.vocab_size=50048, on the bundle's smaller
#             tokenizer: a model vocabulary larger than the tokenizer's is allowed, the ids above it never occur) at
#             micro batch 16 and 32; tools/gpu_check.py's compiled throughput rows at each micro batch: rope, the
#             Hugging Face twin with its loss eager and with its loss inside its compiled region (vocab_summary.md:
#             the users' tokens/s over each)
#   speedrun  the gpu-speedrun pair (RoPE, CoCA slack) with its in-training curve on SPEEDRUN_BUNDLE
#             (tools/gpu/speedrun_pair.sh into OUT/speedrun/)
#   fp8       the users' command with train.fp8 = none, lm_head, mlp, all over the same steps (fp8_summary.md:
#             tokens/s, and losses against none's, the bf16 run; a dry run's FP8 runs stop at their start, as FP8
#             needs a CUDA GPU)
# Environment: PYTHON (python3), GPU_NODE_SITE (/tmp/site), GPU_ACCEPTANCE_WORK (/tmp/gpu_acceptance: scratch,
# checkpoints), GPU_ACCEPTANCE_BUDGET (500: seconds for the whole script), GPU_ACCEPTANCE_PHASES (default,vocab,
# speedrun,fp8: those to run, in that order), GPU_ACCEPTANCE_DRY_RUN (1: as --dry-run), GPU_ACCEPTANCE_PACK (1; 0:
# OUT left unpacked), the phases' caps in seconds GPU_ACCEPTANCE_{DEFAULT,VOCAB,SPEEDRUN,FP8}_S (300, 240, 540,
# 240) and GPU_ACCEPTANCE_TESTS_S (120, within the default phase's cap).
set -u -o pipefail

DRY_RUN=${GPU_ACCEPTANCE_DRY_RUN:-0}
if [ "${1:-}" = --dry-run ]; then DRY_RUN=1; shift; fi
USAGE="bash tools/gpu/acceptance.sh [--dry-run] WHEELS_DIR BUNDLE OUT [SPEEDRUN_BUNDLE]"
[ $# -le 4 ] || { echo "usage: $USAGE" >&2; exit 2; }
# shellcheck source=tools/gpu/setup_offline_node.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_offline_node.sh"
SPEEDRUN_BUNDLE=${1:-$BUNDLE}
[ -f "$SPEEDRUN_BUNDLE" ] || { echo "error: SPEEDRUN_BUNDLE $SPEEDRUN_BUNDLE: no such file"; exit 2; }
SPEEDRUN_BUNDLE=$(cd "$(dirname "$SPEEDRUN_BUNDLE")" && pwd)/$(basename "$SPEEDRUN_BUNDLE")
WORK=${GPU_ACCEPTANCE_WORK:-/tmp/gpu_acceptance}
BUDGET=${GPU_ACCEPTANCE_BUDGET:-500}
PHASES=",${GPU_ACCEPTANCE_PHASES:-default,vocab,speedrun,fp8},"
PACK_S=20  # kept back for packing OUT
MIN_PHASE_S=60
mkdir -p "$WORK"
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor_cache"  # shared by the runs: only the first compile is cold

USERS_CONFIG=configs/coca_350m.yml
if [ "$DRY_RUN" = 1 ]; then
  # a tiny model on CPU in fp32 (bf16 and compiling are CUDA's defaults); the paper's vocabulary stood in for by
  # 1,024, still larger than the tiny bundle's tokenizer
  SIZE=(model.num_layers=2 model.hidden_size=64 model.num_attention_heads=4 model.intermediate_size=256
        model.seq_length=32 model.max_position_embeddings=32 train.train_batch_size=32 precision=fp32
        train.num_workers=0)
  E2E_ITERS=20; E2E_SAVE=4; EVAL_ITERS=2; RUN_ITERS=4; LOG_EVERY=2; PAPER_VOCAB=1024
  THROUGHPUT_FLAGS=(--smoke); SPEEDRUN_FLAGS=(--dry-run --probe-steps 3)
  SPEEDRUN_BUDGET=400  # the dry run's speedrun plan needs a GPU-sized budget; it trains 3 steps whatever it says
else
  SIZE=()
  E2E_ITERS=8; E2E_SAVE=4; EVAL_ITERS=10; RUN_ITERS=12; LOG_EVERY=4; PAPER_VOCAB=50048
  THROUGHPUT_FLAGS=(); SPEEDRUN_FLAGS=()
  SPEEDRUN_BUDGET=""
fi
echo "[t=$(el)] budget ${BUDGET} s, phases ${PHASES//,/ }, dry run ${DRY_RUN}, work $WORK"

# setup: the users' data
DATA_ARGS=$(timeout 180 "$PY" -m megatron_lite.bench.users_command "$BUNDLE" "$WORK/data")
if [ $? -ne 0 ] || [ -z "$DATA_ARGS" ]; then
  echo "error: BUNDLE $BUNDLE did not unpack"; exit 1
fi
read -r _ MIX _ TOKENIZER _ VOCAB <<< "$DATA_ARGS"
DATA=("data.mix=\"$MIX\"" "data.cache_dir=\"$WORK/cache\"" "data.tokenizer.model=\"$TOKENIZER\""
      "train.wandb.mode=disabled")
echo "[t=$(el)] setup done: mix $MIX, tokenizer $TOKENIZER (vocabulary $VOCAB)"

PHASE_DEADLINE=0
FAILED=0
LAUNCHED=""
# stopped from outside: the users' run in progress (its own process group, under its timeout) is stopped too
trap '[ -n "$LAUNCHED" ] && kill -TERM -- "-$LAUNCHED" 2>/dev/null; exit 143' TERM INT
left() {  # seconds to the phase's deadline, at least 1 (a timeout of 0 would be none)
  local seconds=$(( PHASE_DEADLINE - $(el) ))
  echo $(( seconds > 1 ? seconds : 1 ))
}
start_phase() {  # NAME CAP: 0 and the phase's deadline set if it is chosen and has time, else 1
  if [[ "$PHASES" != *",$1,"* ]]; then return 1; fi
  local room=$(( BUDGET - $(el) - PACK_S ))
  local cap=$(( room < $2 ? room : $2 ))
  if [ "$cap" -lt "$MIN_PHASE_S" ]; then
    echo "[t=$(el)] phase $1 skipped: ${room} s left of the ${BUDGET} s budget (at least ${MIN_PHASE_S} s needed)"
    echo "$1 skipped: ${room} s left" >> "$OUT/phases.txt"
    return 1
  fi
  PHASE_DEADLINE=$(( $(el) + cap ))
  PHASE_START=$(el)
  echo "[t=$(el)] phase $1: start (deadline t=${PHASE_DEADLINE})"
}
end_phase() {  # NAME RC
  echo "[t=$(el)] phase $1: done, exit $2, $(( $(el) - PHASE_START )) s"
  echo "$1 exit $2 in $(( $(el) - PHASE_START )) s" >> "$OUT/phases.txt"
  [ "$2" -eq 0 ] || FAILED=1
}

# The users' command with the phase's settings: NAME [KEY=VALUE ...] in $WORK/runs/NAME, its log and metrics
# into OUT as NAME_log.txt and NAME_metrics.jsonl, its exit code into $WORK/runs/NAME.exit; under the phase's
# deadline. RESUME (none) is its --resume. users_start starts it in the background: LAUNCHED is the pid of its
# timeout, which leads the run's process group (the launcher and its rank); users_finish waits for it.
users_start() {
  local name=$1 run=$WORK/runs/$1; shift
  local sets=() setting
  for setting in "${DATA[@]}" "${SIZE[@]}" "$@"; do sets+=(--set "$setting"); done
  if [ "${RESUME:-none}" = none ]; then rm -rf "$run" "$run.exit"; : > "$OUT/${name}_log.txt"; fi
  mkdir -p "$WORK/runs"
  echo "[t=$(el)] $name: deepspeed --num_gpus 1 train.py --config $USERS_CONFIG ${sets[*]} --resume ${RESUME:-none}"
  timeout -k 20 "$(left)" "$PY" -m deepspeed.launcher.runner --num_gpus 1 --master_port $(( 20000 + RANDOM % 20000 )) \
    train.py --config "$USERS_CONFIG" --run-dir "$run" --resume "${RESUME:-none}" "${sets[@]}" \
    >> "$OUT/${name}_log.txt" 2>&1 &
  LAUNCHED=$!
}
users_finish() {  # NAME: its exit code
  local name=$1 run=$WORK/runs/$1 rc
  wait "$LAUNCHED"
  rc=$?
  LAUNCHED=""
  echo "$rc" > "$run.exit"
  [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$OUT/${name}_metrics.jsonl"
  echo "[t=$(el)] $name exited $rc: $(grep -a '^done:\|^error:' "$OUT/${name}_log.txt" | tail -n 1)"
  return "$rc"
}
users_run() { users_start "$@" && users_finish "$1"; }
latest_complete_step() {  # RUN_DIR: the step of its latest complete checkpoint, or 0
  local marker
  marker=$(ls -d "$1"/checkpoints/step_*/COMPLETE 2>/dev/null | sort | tail -n 1)
  if [ -n "$marker" ]; then basename "$(dirname "$marker")" | sed 's/^step_0*//'; else echo 0; fi
}

# default: train, validate, save, killed, resumed; against an uninterrupted run; converted; the GPU tests
if start_phase default "${GPU_ACCEPTANCE_DEFAULT_S:-300}"; then
  TESTS_S=${GPU_ACCEPTANCE_TESTS_S:-120}
  PHASE_DEADLINE=$(( PHASE_DEADLINE - TESTS_S ))  # the tests' share, kept for them
  E2E=(model.vocab_size="$VOCAB" train.train_iters=$E2E_ITERS train.eval_interval=$E2E_SAVE
       train.eval_iters=$EVAL_ITERS train.save_interval=$E2E_SAVE train.log_interval=1)
  KILLED=$WORK/runs/e2e_killed
  users_start e2e_killed "${E2E[@]}"
  while kill -0 "$LAUNCHED" 2>/dev/null && [ "$(latest_complete_step "$KILLED")" = 0 ]; do
    sleep 0.2
  done
  KILLED_AT=$(latest_complete_step "$KILLED")
  if kill -0 "$LAUNCHED" 2>/dev/null; then
    kill -KILL -- "-$LAUNCHED"  # the run's process group, the rank included: no chance to save or clean up
    users_finish e2e_killed
    RESUMED_FROM=$(latest_complete_step "$KILLED")
    echo "[t=$(el)] e2e_killed: SIGKILL once step ${KILLED_AT}'s checkpoint was complete;" \
      "resuming from step $RESUMED_FROM"
  else
    users_finish e2e_killed
    RESUMED_FROM=$KILLED_AT
    echo "[t=$(el)] e2e_killed ended before it could be killed (latest complete checkpoint: step $RESUMED_FROM)"
  fi
  RESUME=auto users_run e2e_killed "${E2E[@]}"
  E2E_RC=$?
  users_run e2e_reference "${E2E[@]}" train.save_interval=0 train.save_final=false
  [ $? -ne 0 ] && E2E_RC=1
  timeout 60 "$PY" -m megatron_lite.bench.gpu_check_acceptance resume "$KILLED" "$WORK/runs/e2e_reference" \
    "$RESUMED_FROM" "$OUT/e2e_resume" > /dev/null || E2E_RC=1
  rm -rf "$WORK/hf"
  timeout -k 10 "$(( $(left) > 30 ? $(left) : 30 ))" "$PY" tools/convert_checkpoint.py "$KILLED" "$WORK/hf" --to hf \
    > "$OUT/e2e_convert.txt" 2>&1
  CONVERT_RC=$?
  ls -la "$WORK/hf" >> "$OUT/e2e_convert.txt" 2>&1
  echo "[t=$(el)] converted to Hugging Face: exit $CONVERT_RC ($(grep -a -- ' -> ' "$OUT/e2e_convert.txt" | tail -n 1))"
  [ "$CONVERT_RC" -ne 0 ] && E2E_RC=1
  rm -rf "$WORK/hf" "$KILLED/checkpoints"  # GBs at the 350M size
  PHASE_DEADLINE=$(( PHASE_DEADLINE + TESTS_S ))
  timeout -k 10 "$(left)" "$PY" -m pytest -v -p no:cacheprovider -m gpu tests/test_cuda_path.py \
    > "$OUT/gpu_tests.txt" 2>&1
  TESTS_RC=$?
  echo "[t=$(el)] GPU tests exited $TESTS_RC: $(tail -n 1 "$OUT/gpu_tests.txt")"
  end_phase default "$(( E2E_RC || (TESTS_RC != 0 && TESTS_RC != 5) ))"  # 5: every test skipped (no CUDA)
fi

# vocab: the users' command at the paper's vocabulary, micro batch 16 and 32, beside the twin's compiled rows
if start_phase vocab "${GPU_ACCEPTANCE_VOCAB_S:-240}"; then
  RC=0
  SUMMARY=()
  for MICRO in 16 32; do
    users_run "vocab_mb$MICRO" model.vocab_size=$PAPER_VOCAB train.train_micro_batch_size_per_gpu=$MICRO \
      train.train_iters=$RUN_ITERS train.log_interval=$LOG_EVERY train.eval_interval=0 train.save_interval=0 \
      train.save_final=false || RC=1
    rm -rf "$WORK/twin_mb$MICRO"
    timeout -k 10 "$(left)" "$PY" tools/gpu_check.py --quick "${THROUGHPUT_FLAGS[@]}" --force --only throughput \
      --schemes rope --micro-batch "$MICRO" --twin-loss eager,compiled --out "$WORK/twin_mb$MICRO" --no-board \
      > "$OUT/twin_mb${MICRO}_log.txt" 2>&1 || RC=1
    for kind in json md; do
      [ -f "$WORK/twin_mb$MICRO/gpu_check.$kind" ] && cp "$WORK/twin_mb$MICRO/gpu_check.$kind" \
        "$OUT/twin_mb${MICRO}_gpu_check.$kind"
    done
    SUMMARY+=(--run "vocab_mb$MICRO=$WORK/runs/vocab_mb$MICRO"
              --twin "vocab_mb$MICRO=$WORK/twin_mb$MICRO/gpu_check.json")
  done
  timeout 60 "$PY" -m megatron_lite.bench.gpu_check_acceptance runs "$OUT/vocab_summary" "${SUMMARY[@]}" || RC=1
  end_phase vocab "$RC"
fi

# speedrun: the pair on unique data, with the in-training curve (its own setup: wheels already installed)
if start_phase speedrun "${GPU_ACCEPTANCE_SPEEDRUN_S:-540}"; then
  SPEEDRUN_BUDGET=${SPEEDRUN_BUDGET:-$(left)}
  SPEEDRUN_WORK="$WORK/speedrun" SPEEDRUN_BUDGET=$SPEEDRUN_BUDGET timeout -k 20 "$(left)" \
    bash tools/gpu/speedrun_pair.sh - "$SPEEDRUN_BUNDLE" "$OUT/speedrun" "${SPEEDRUN_FLAGS[@]}" > /dev/null
  end_phase speedrun $?
fi

# fp8: the users' command's tokens/s and losses with each train.fp8 over the same steps, none (bf16) first
if start_phase fp8 "${GPU_ACCEPTANCE_FP8_S:-240}"; then
  RC=0
  SUMMARY=()
  for FP8 in none lm_head mlp all; do
    if ! users_run "fp8_$FP8" model.vocab_size=$PAPER_VOCAB train.fp8=$FP8 train.train_iters=$RUN_ITERS \
        train.log_interval=1 train.eval_interval=0 train.save_interval=0 train.save_final=false; then
      if [ "$DRY_RUN" = 1 ] && [ "$FP8" != none ] \
          && grep -aq "FP8 matmuls need a CUDA GPU" "$OUT/fp8_${FP8}_log.txt"; then
        echo "[t=$(el)] fp8_$FP8 stopped at its start, as it must on a CPU: the key and value were accepted"
      else
        RC=1
      fi
    fi
    SUMMARY+=(--run "fp8_$FP8=$WORK/runs/fp8_$FP8")
  done
  timeout 60 "$PY" -m megatron_lite.bench.gpu_check_acceptance runs "$OUT/fp8_summary" "${SUMMARY[@]}" || RC=1
  end_phase fp8 "$RC"
fi

echo "[t=$(el)] end: $OUT"
cat "$OUT/phases.txt" 2>/dev/null
if [ "${GPU_ACCEPTANCE_PACK:-1}" = 1 ]; then
  exec >/dev/null 2>&1 && sleep 1  # the tee has then written the last of log.txt before it is packed
  bash "$REPO/tools/gpu/pack_results.sh" "$OUT"
fi
exit "$FAILED"
