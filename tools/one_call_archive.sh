#!/usr/bin/env bash
# Packs a one-call job's OUT for a device tool that brings back at most 8 files of at most 16 MiB each:
#
#   bash tools/one_call_archive.sh OUT
#
# Every file but the profiler's traces goes into OUT/results.tar.xz; each trace (*trace*, already gzip'd, a few
# MB each) stays a file of its own, so that one trace too large to come back does not take the others with it.
# More than 7 traces go together into OUT/traces.tar instead. results.tar.xz is written beside and then renamed, so
# a job cut while packing keeps the previous one (a call that packs after each stage, docs/gpu_runs/next/call_b.sh).
# Run by tools/gpu_one_call.sh (GPU_ONE_CALL_ARCHIVE=1).
set -u -o pipefail
[ $# -eq 1 ] && [ -d "$1" ] || { echo "usage: bash tools/one_call_archive.sh OUT" >&2; exit 2; }
cd "$1" || exit 1
shopt -s nullglob
traces=(*trace*)
others=()
for name in *; do
  case "$name" in *trace*|results.tar.xz|results.tar.xz.part) ;; *) others+=("$name") ;; esac
done
if [ ${#others[@]} -gt 0 ]; then
  tar -cJf results.tar.xz.part "${others[@]}" && mv results.tar.xz.part results.tar.xz && rm -rf "${others[@]}" \
    || exit 1
fi
if [ ${#traces[@]} -gt 7 ]; then
  tar -cf traces.tar "${traces[@]}" && rm -f "${traces[@]}" || exit 1
fi
