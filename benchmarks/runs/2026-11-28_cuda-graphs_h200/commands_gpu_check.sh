#!/usr/bin/env bash
# Prepared 2026-11-28 (ninth session, no GPU; the eleventh moved the micro-batch-32 run to call B, as three users'
# runs of ~80 s each did not fit beside the rest) for the next session lent a GPU: issue 35's remaining figures.
# From the repository root, with .gpu/ holding whl/ (tools/fetch_wheels.py) and bundle30m.tar.xz (+ .sha256):
#   cp docs/gpu_runs/next/call_*.sh .gpu/   (after building .gpu/whl and .gpu/bundle30m.tar.xz: docs/gpu.md,
#                                             "What the next GPU run should show")
#   run: bash .gpu/call_a.sh "$OUT" 480     (device tool: carry [".gpu"], timeout_s 510; leaves call B and the start
#                                             room in 15 minutes)
# The sixteenth session added the rope row compiled with the users' fewer_launches inductor settings at micro batch 64
# (--compile-mode regional,regional-fewer-launches: ~15-20 s), what those settings do to the GPU's own time where the
# host does not bind, beside call B's users' rows, where they also cut the host's launches.
# Everything comes back as $OUT/results.tar.xz and the traces, one file each (the device tool returns at most 8 files).
set -u
OUT=$1; BUDGET=${2:-480}
GPU_ONE_CALL_ARCHIVE=1 GPU_ONE_CALL_BUDGET=$BUDGET GPU_ONE_CALL_TESTS_S=150 \
  bash tools/gpu_one_call.sh .gpu/whl .gpu/bundle30m.tar.xz "$OUT" \
  --only env,throughput,users_command,sync --schemes rope,coca_slack,coca_strict \
  --users-micro-batch 16 --users-cuda-graphs 16 --sdpa-kernel auto,flash --compile-mode regional,regional-fewer-launches
ls -la "$OUT"
