#!/usr/bin/env bash
# Prepared 2026-11-28 (seventeenth session, after Run 4) for the next session lent a GPU: issue 35's re-check with
# train.cuda_graphs on by default (null: on for the paper config on CUDA), in the order of what matters most.
# From the repository root, with .gpu/ holding whl/ (tools/fetch_wheels.py) and bundle30m.tar.xz (+ .sha256):
#   cp docs/gpu_runs/next/call_*.sh .gpu/   (after building .gpu/whl and .gpu/bundle30m.tar.xz: docs/gpu.md,
#                                             "What the next GPU run should show")
#   run: bash .gpu/call_a.sh "$OUT" 500     (device tool: carry [".gpu"], timeout_s 530; leaves call B and the start
#                                             room in 15 minutes)
# 1. the GPU tests, with the new train.py run that trains, saves and resumes with the default CUDA graphs (~60-90 s
#    more than Run 4's 81 s: 240 s allowed);
# 2. the quick check: the throughput rows and a rope row compiled with CUDA graphs at micro batch 64 (the 1.3x twin
#    target with the training default's graphs), the users' command as it now runs by default (CUDA graphs) at the
#    paper's micro batch of 16, and the sync section (micro batch 32 is call B's: with the longer tests, a second
#    users' run would not fit in 500 s); last in the throughput section (added 2026-11-28, nineteenth session), rope
#    with train.loss_gemm input_dtype (bf16 logits) eager and compiled, ~25 s. Expected: tests ~200 s, the check
#    ~255 s.
# Everything comes back as $OUT/results.tar.xz and the traces, one file each (the device tool returns at most 8 files).
set -u
OUT=$1; BUDGET=${2:-500}
GPU_ONE_CALL_ARCHIVE=1 GPU_ONE_CALL_BUDGET=$BUDGET GPU_ONE_CALL_TESTS_S=240 \
  bash tools/gpu_one_call.sh .gpu/whl .gpu/bundle30m.tar.xz "$OUT" \
  --only env,throughput,users_command,sync --schemes rope,coca_slack,coca_strict \
  --users-micro-batch 16 --compile-mode regional,regional-cudagraphs --loss-gemm mixed,input_dtype
ls -la "$OUT"
