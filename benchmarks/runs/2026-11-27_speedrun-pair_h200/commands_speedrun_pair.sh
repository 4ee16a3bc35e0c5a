#!/usr/bin/env bash
# The commands of the 2026-11-27 speedrun pair, as run: the gpu-speedrun pair (RoPE, CoCA slack) with the
# in-training curve, after the quick check on the same machine, with a lighter final evaluation so that training
# gets most of the budget. The script paths are those of the time; today's:
# tools/gpu/speedrun_pair.sh. Usage then: bash SCRIPT OUT SPEEDRUN_BUDGET_S [extra reproduce.py arguments]
set -u
OUT=$1; export SPEEDRUN_BUDGET=$2; shift 2; R=/tmp/res_b; rm -rf "$R"; mkdir -p "$R"
WHEELS=${CALL_B_WHEELS:-.gpu/whl}; [ -d /tmp/site/deepspeed ] && WHEELS=-  # installed by the GPU check run just before, on the same machine
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1
bash tools/speedrun_one_call.sh "$WHEELS" .gpu/bundle.tar.xz "$R" --eval-seconds 20 --ntk-factors 4 --max-docs 10 \
  --passkey-cases 20 --passkey-lengths 512,1024,2048 --set train.profile.start_step=50 --set train.profile.steps=1 \
  "$@" > /dev/null 2>&1
echo "speedrun exited $?" >> "$R/log.txt"
cd "$R" && tar -cJf "$OUT/b.tar.xz" --exclude='*trace*' . ; tar -cJf "$OUT/b_traces.tar.xz" $(ls | grep trace) 2>/dev/null
ls -la "$R" "$OUT"; grep "^\[t=\|GPU plan\|steps\b" "$R/log.txt" | cut -c1-300 | tail -25
