#!/usr/bin/env bash
# The commands of the 2026-11-28 quick check, as run: the CUDA tests and the quick check (users' command at micro
# batch 16 with and without CUDA graphs, rope/coca_slack/coca_strict throughput, the compiled rope row with
# inductor's fewer-launches settings at micro batch 64, host syncs), before the users' variants
# (users_command_variants/). From the repository root, with .gpu/ holding whl/ (tools/fetch_wheels.py) and
# bundle30m.tar.xz (+ .sha256). The script paths and settings are those of the time;
# today's: tools/gpu/check_gpu.sh with its GPU_CHECK_* settings.
# Usage then: bash SCRIPT OUT BUDGET_S. Everything comes back as $OUT/results.tar.xz and the traces, one file each.
set -u
OUT=$1; BUDGET=${2:-480}
GPU_ONE_CALL_ARCHIVE=1 GPU_ONE_CALL_BUDGET=$BUDGET GPU_ONE_CALL_TESTS_S=150 \
  bash tools/gpu_one_call.sh .gpu/whl .gpu/bundle30m.tar.xz "$OUT" \
  --only env,throughput,users_command,sync --schemes rope,coca_slack,coca_strict \
  --users-micro-batch 16 --users-cuda-graphs 16 --sdpa-kernel auto,flash --compile-mode regional,regional-fewer-launches
ls -la "$OUT"
