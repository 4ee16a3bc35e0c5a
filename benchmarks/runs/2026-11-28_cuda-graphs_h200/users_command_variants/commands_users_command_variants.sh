#!/usr/bin/env bash
# The commands of the 2026-11-28 users' variants, as run right after ../commands_gpu_check.sh on the same machine
# (its wheels in /tmp/site), in priority order so that a cut job keeps the first ones:
#   1. the users' command at micro batch 16 with inductor's combo kernels and without its mix-order reduction
#      (fewer_launches: 41 -> 28 launches per block and micro batch), then with those and 4 blocks per compiled
#      region as well (fewer_launches_blocks_of_4), then at micro batch 32, then at 16 with 4 blocks per region
#      alone (blocks_of_4: 50 -> 14 region calls per micro batch), then at 16 with train.compile_cpp_wrapper=true
#      (not reached) -> users_b.json (the rows), each run's log, metrics and profile
#   2. the speedrun's throughput probe (30 steps each of rope and coca_slack, 41.6M, ZeRO 1) with
#      train.cuda_graphs true, then false -> probe_{true,false}.txt / .json (not reached)
# Everything but the traces is re-packed into OUT/results.tar.xz after each stage and each trace copied to OUT.
# The script paths are those of the time; today's packing is tools/gpu/pack_results.sh. Two variables below
# switched a CPU dry run of the script (CUDA rows skipped, no probes).
set -u
OUT=$1; RES=/tmp/res_b; rm -rf "$RES"; mkdir -p "$RES"
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
pack() {  # all of RES so far, again: results.tar.xz and each trace a file (tools/one_call_archive.sh)
  cp -r "$RES"/. "$OUT"/ && bash tools/one_call_archive.sh "$OUT"
}
exec > >(tee -a "$RES/log.txt") 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1 WANDB_MODE=disabled \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -d /tmp/site ] || { echo "no /tmp/site: the wheels are not installed on this machine yet; installing them";
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl; }
DATA_ARGS=$(timeout 120 python3 -m megatron_lite.bench.users_command .gpu/bundle30m.tar.xz /tmp/gpu_one_call/data)
echo "[t=$(el)] data: $DATA_ARGS"
users_run() {  # MICRO_BATCH [VARIANT]: one users' command run, its row appended to users_b.json, its files to RES
  # shellcheck disable=SC2086
  timeout 175 python3 - $DATA_ARGS "$RES" "$1" "${2:-}" <<'PY'
import json, os, shutil, sys
from pathlib import Path
from megatron_lite.bench.users_command import run_users_command
_, _, mix, _, tokenizer, _, vocab, out, micro_batch, variant = sys.argv
cuda = os.environ.get("CALL_B_CUDA", "1") == "1"  # 0: a dry run of this script on a CPU (the rows say skipped)
work, out, micro_batch, variant = Path("/tmp/users_b"), Path(out), int(micro_batch), variant or None
rows_path = out / "users_b.json"
rows = json.loads(rows_path.read_text()) if rows_path.is_file() else []
rows += run_users_command(Path(mix), Path(tokenizer), int(vocab), work, cuda=cuda, timeout_s=160, progress=print,
                          micro_batch=micro_batch, variant=variant)
rows_path.write_text(json.dumps(rows, indent=1, default=str))
print({key: value for key, value in rows[-1].items() if key != "warning_lines"}, flush=True)
suffix = f"_micro_batch_{micro_batch}" + (f"_{variant}" if variant else "")
run = work / f"run{suffix}"
for source in [work / f"log{suffix}.txt", run / "metrics.jsonl", *sorted((run / "profile").glob("*"))]:
    if source.is_file() and source.stat().st_size < 16_000_000:
        shutil.copy(source, out / f"users{suffix}_{source.name}")
PY
  echo "[t=$(el)] the users' command at $1 ${2:-} exited $?"; pack
}
users_run 16 fewer_launches
users_run 16 fewer_launches_blocks_of_4
users_run 32
users_run 16 blocks_of_4
users_run 16 cpp_wrapper
[ "${CALL_B_PROBES:-1}" = 1 ] || { ls -la "$OUT"; exit 0; }  # 0: no speedrun probes (a dry run)
for graphs in true false; do
  timeout 100 python3 tools/reproduce.py --profile gpu-speedrun --bundle .gpu/bundle30m.tar.xz \
    --out "/tmp/probe_$graphs" --only data,probe --no-board --set "train.cuda_graphs=$graphs" \
    > "$RES/probe_$graphs.txt" 2>&1
  echo "[t=$(el)] cuda_graphs=$graphs exited $?"; cp "/tmp/probe_$graphs/probe.json" "$RES/probe_$graphs.json"
  grep "probe:" "$RES/probe_$graphs.txt" | tail -2
  pack
done
ls -la "$OUT"
