#!/usr/bin/env bash
# Packs a GPU job's OUT for a job that brings back only a few files (at most 8 of at most 16 MiB each, say):
#
#   bash tools/gpu/pack_results.sh OUT
#
# Every file but the profiler's traces goes into OUT/results.tar.xz; each trace (*trace*, already gzip'd, a few
# MB each) stays a file of its own, so that one trace too large to come back does not take the others with it.
# More than 7 traces go together into OUT/traces.tar instead. results.tar.xz is written beside and then renamed, so
# a job cut while packing keeps the previous one (tools/gpu/acceptance.sh packs after each phase).
# Run by tools/gpu/check_gpu.sh (GPU_CHECK_PACK=1) and tools/gpu/acceptance.sh.
set -u -o pipefail
[ $# -eq 1 ] && [ -d "$1" ] || { echo "usage: bash tools/gpu/pack_results.sh OUT" >&2; exit 2; }
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
