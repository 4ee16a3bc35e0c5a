#!/usr/bin/env bash
# The commands of the 2026-11-27 quick check, as run: the CUDA tests, then the quick check with a budget that
# left the rest of the job to the speedrun pair (2026-11-27_speedrun-pair_h200). Results in /tmp/res_a, brought
# back as two archives. The script paths are those of the time; today's: tools/gpu/check_gpu.sh.
# Usage then: bash SCRIPT OUT CHECK_BUDGET_S [extra gpu_check.py arguments]
set -u
OUT=$1; BUDGET=$2; shift 2; R=/tmp/res_a; rm -rf "$R"; mkdir -p "$R"; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1
echo "[t=$(el)] gpu tests" > "$R/extras.txt"
timeout 50 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_path.py >> "$R/extras.txt" 2>&1
echo "[t=$(el)] gpu tests exited $?" >> "$R/extras.txt"
GPU_ONE_CALL_BUDGET=$(( BUDGET - $(el) )) bash tools/gpu_one_call.sh - .gpu/bundle.tar.xz "$R" \
  --only env,throughput,users_command,sync,memory --schemes rope,coca_slack --users-micro-batch 16 \
  --compile-mode regional "$@" > /dev/null 2>&1
echo "[t=$(el)] check exited $?" >> "$R/extras.txt"
cd "$R" && tar -cJf "$OUT/a.tar.xz" --exclude='*trace*' . ; tar -cJf "$OUT/a_traces.tar.xz" $(ls | grep trace) 2>/dev/null
ls -la "$R" "$OUT"; cat "$R/extras.txt"; grep -h "status=\|mfu" "$R/log.txt" | cut -c1-400 | tail -20
