#!/usr/bin/env bash
# One short GPU check for a lent machine (at most 15 minutes, no network): ViT-B-16 bf16 training
# throughput and model-FLOP utilisation, our step against open_clip_train's, and the tiled clip loss's
# memory at B = 65,536 against open_clip's ClipLoss. Writes $OUT/gpu.json (default bench_results/raw).
#
#   scripts/bench_gpu.sh [--wheels DIR] [-- GPU_BENCH_ARGS...]
#
# Uses the machine's python and torch (CUDA). The project is installed without dependencies; its
# runtime dependencies that the machine lacks (open_clip_torch, ...) come from --wheels DIR (default
# wheels/), prepared beforehand where there is network:
#   pip download -d wheels --no-deps open_clip_torch ftfy wcwidth timm huggingface_hub safetensors \
#       pydantic pydantic_core annotated_types typing_inspection accelerate psutil
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=wheels; python=${PYTHON:-python3}; out=${OUT:-bench_results/raw}
while [ $# -gt 0 ]; do
    case $1 in
        --wheels) wheels=$2; shift 2;;
        --) shift; break;;
        -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2;;
    esac
done
$python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
if ! $python -c "import open_clip, pydantic, accelerate" 2>/dev/null; then
    [ -d "$wheels" ] || { echo "open_clip/pydantic/accelerate missing and no wheels in $wheels (see --help)" >&2; exit 2; }
    $python -m pip install --no-index --find-links "$wheels" --no-deps "$wheels"/*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
mkdir -p "$out"
timeout 780 $python scripts/gpu_bench.py --out "$out" "$@"
