#!/usr/bin/env bash
# Prepared 2026-11-28 (eleventh session, no GPU): call B, right after call_a.sh on the same warm machine (its
# wheels in /tmp/site). In priority order, as the session's remaining device time may cut it short:
#   1. the users' command at micro batch 16 with train.compile_cpp_wrapper=true (gpu_check's --users-cpp-wrapper
#      row, run alone: call A ran the plain row) -> OUT/users_cpp_wrapper.json, its log, metrics and profile
#   2. the speedrun's throughput probe (30 steps each of rope and coca_slack, 41.6M, ZeRO 1) with
#      train.cuda_graphs true, then false -> OUT/probe_{true,false}.txt / .json
#   run: bash .gpu/call_b.sh "$OUT"     (device tool: carry [".gpu"], timeout_s: what is left, <= 420)
set -u
OUT=$1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1 WANDB_MODE=disabled \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -d /tmp/site ] || { echo "no /tmp/site: the machine is not call A's; installing the wheels";
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl; }
DATA_ARGS=$(timeout 120 python3 -m megatron_lite.bench.users_command .gpu/bundle30m.tar.xz /tmp/gpu_one_call/data)
echo "[t=$(el)] data: $DATA_ARGS"
# shellcheck disable=SC2086
timeout 230 python3 - $DATA_ARGS "$OUT" <<'PY'
import json, shutil, sys
from pathlib import Path
from megatron_lite.bench.users_command import run_users_command
_, _, mix, _, tokenizer, _, vocab, out = sys.argv
work, out = Path("/tmp/users_b"), Path(out)
rows = run_users_command(Path(mix), Path(tokenizer), int(vocab), work, cuda=True, timeout_s=215, progress=print,
                         micro_batch=16, variant="cpp_wrapper")
(out / "users_cpp_wrapper.json").write_text(json.dumps(rows, indent=1, default=str))
for row in rows:
    print({key: value for key, value in row.items() if key != "warning_lines"})
run = work / "run_micro_batch_16_cpp_wrapper"
for source in [work / "log_micro_batch_16_cpp_wrapper.txt", run / "metrics.jsonl", *sorted((run / "profile").glob("*"))]:
    if source.is_file() and source.stat().st_size < 30_000_000:
        shutil.copy(source, out / f"users_cpp_wrapper_{source.name}")
PY
echo "[t=$(el)] users' command with the C++ wrapper exited $?"
for graphs in true false; do
  timeout 100 python3 tools/reproduce.py --profile gpu-speedrun --bundle .gpu/bundle30m.tar.xz \
    --out "/tmp/probe_$graphs" --only data,probe --no-board --set "train.cuda_graphs=$graphs" \
    > "$OUT/probe_$graphs.txt" 2>&1
  echo "[t=$(el)] cuda_graphs=$graphs exited $?"; cp "/tmp/probe_$graphs/probe.json" "$OUT/probe_$graphs.json"
  grep "probe:" "$OUT/probe_$graphs.txt" | tail -2
done
ls -la "$OUT"
