# Sourced by the scripts of tools/gpu/ (not run by itself): the common start of a GPU job on a bare, offline node.
# Reads the caller's positional arguments WHEELS_DIR BUNDLE OUT and shifts them off, leaving the extra arguments;
# sets REPO, PY, SITE, WHEELS, BUNDLE, OUT, T0 and el() (seconds since the start); tees everything printed into
# OUT/log.txt; installs the wheels into SITE ('-': nothing) and exports the offline environment; prints the GPU and
# the package versions (torchao's too, where installed: train.fp8). The caller sets USAGE first.
# Environment: PYTHON (python3), GPU_NODE_SITE (/tmp/site: where the wheels are installed).
if [ $# -lt 3 ]; then
  echo "usage: $USAGE" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
SITE=${GPU_NODE_SITE:-/tmp/site}
WHEELS=$1
if [ "$WHEELS" != "-" ]; then
  WHEELS=$(cd "$WHEELS" 2>/dev/null && pwd) || { echo "error: WHEELS_DIR $1: no such directory" >&2; exit 2; }
fi
[ -f "$2" ] || { echo "error: BUNDLE $2: no such file" >&2; exit 2; }
BUNDLE=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
mkdir -p "$3" && OUT=$(cd "$3" && pwd) || { echo "error: OUT $3: cannot create it" >&2; exit 2; }
shift 3

T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "[t=$(el)] $(basename "$0"): repo $REPO, wheels $WHEELS, bundle $BUNDLE, out $OUT"
cd "$REPO" || exit 1

if [ "$WHEELS" != "-" ]; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  [ ${#wheels[@]} -gt 0 ] || { echo "error: WHEELS_DIR $WHEELS holds no .whl files"; exit 2; }
  timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" || { echo "error: installing the wheels failed"; exit 1; }
  export PATH="$SITE/bin:$PATH"
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
timeout 120 "$PY" -c "import importlib.metadata as m, sys, torch, deepspeed, transformers
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return 'missing'
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed',
      deepspeed.__version__, 'transformers', transformers.__version__, 'torchao', version('torchao'))" \
  || { echo "error: the Python packages do not import"; exit 1; }
