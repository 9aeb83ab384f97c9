#!/usr/bin/env bash
# The GPU check rehearsed under the device image's versions (`make gpu-rehearsal`): a Python 3.12 venv
# with scripts/bench/device_image.txt (torch 2.11.0, torchvision 0.26.0, accelerate 1.15.0,
# transformers 5.17.0, ...), the cp312 bundle `make gpu-bundle` builds installed over it by
# bench_gpu.sh exactly as on the device, then bench_gpu.sh --cpu end to end. gpu.json in OUT
# (default bench_results/rehearsal). Needs PyPI the first time (~3 GB: torch's CUDA build).
#
#   scripts/bench/gpu_rehearsal.sh [VENV] [-- GPU_BENCH_ARGS]   (default .cache/rehearsal-venv; PYTHON312=...
#                                                               the interpreter, BUNDLE=... the bundle)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.cache/rehearsal-venv
if [ $# -gt 0 ] && [ "$1" != "--" ]; then venv=$1; shift; fi
[ "${1:-}" = "--" ] && shift; out=${OUT:-bench_results/rehearsal}; bundle=${BUNDLE:-.cache/gpu-bundle}
if [ -e "$venv" ] && [ ! -f "$venv/.mmpt-rehearsal" ]; then
    echo "error: $venv exists and was not made by this script; give another VENV" >&2; exit 2
fi
py312=""
for c in ${PYTHON312:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do  # a pyenv shim may not run
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312=$c; break; fi
done
[ -n "$py312" ] || { echo "error: no Python 3.12 found (the device image's); set PYTHON312=/path/to/python3.12" >&2; exit 2; }
if [ ! -f "$venv/.mmpt-rehearsal" ] || ! cmp -s scripts/bench/device_image.txt "$venv/.mmpt-rehearsal"; then
    rm -rf "$venv"
    "$py312" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r scripts/bench/device_image.txt
    cp scripts/bench/device_image.txt "$venv/.mmpt-rehearsal"  # what it holds; a changed list rebuilds it
fi
[ -d "$bundle/wheels" ] || { echo "error: no bundle in $bundle: run make gpu-bundle first" >&2; exit 2; }
site=$(mktemp -d)/site
mkdir -p "$out"
PYTHON="$venv/bin/python" MMPT_SITE="$site" OUT="$out" PYTHONPATH="" \
    bash scripts/bench/bench_gpu.sh --bundle "$bundle" --cpu -- "$@"
