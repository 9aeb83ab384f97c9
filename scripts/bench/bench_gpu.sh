#!/usr/bin/env bash
# The one GPU check, for a lent GPU machine without network (about 5 minutes on one H200). Here, first:
#     make gpu-bundle          # wheels for the device's Python 3.12 + a small embedded dataset, ~20 MiB
# then on the GPU machine, from the repository root (the bundle carried along, e.g. the device tool's
# carry=[".cache/gpu-bundle"]):
#     scripts/bench/bench_gpu.sh [--bundle DIR] [--cpu] [-- GPU_BENCH_ARGS...]     (--cpu: the tiny CPU path, make test)
# It installs the bundle's wheels into /tmp/mmpt-site (only those the machine lacks; nothing of its own is
# changed), then runs scripts/bench/gpu_bench.py on the bundle's dataset: our train_step against
# open_clip_train's (ViT-B-16 bf16, samples/s, MFU), the tiled loss's memory at B = 65,536 against
# open_clip's, bf16 agreement of every objective, k-means (scikit-learn vs torch), and 1-GPU
# train/checkpoint/resume/eval/export through `accelerate launch` with the DDP, FSDP and DeepSpeed
# configs. Results: $OUT/gpu.json if OUT is set (the device tool's), else bench_results/gpu.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=.cache/gpu-bundle; python=${PYTHON:-python3}; out=${OUT:-bench_results}; cpu=()
while [ $# -gt 0 ]; do
    case $1 in
        --bundle) bundle=$2; shift 2;;
        --cpu) cpu=(--device cpu --precision fp32 --model mmpt-tiny-vit --batch-size 16 --steps 1 --repeats 2
                    --loss-batch 256 --precision-batch 128 --kmeans-rows 512 --kmeans-dim 32 --engines fsdp
                    --engine-wrapper tests/scripts/gpu_engine_on_cpu.py); shift;;
        --) shift; break;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2;;
    esac
done
[ -d "$bundle/wheels" ] && [ -d "$bundle/openmoji/train" ] || {
    echo "error: no bundle in $bundle (run \`make gpu-bundle\` where there is network, and carry it)" >&2; exit 2; }
[ ${#cpu[@]} -gt 0 ] || $python -c "import torch, sys; torch.cuda.is_available() or sys.exit('error: no CUDA device (--cpu runs the tiny CPU path)'); print('torch', torch.__version__, torch.cuda.get_device_name())"
site=/tmp/mmpt-site
if [ ${#cpu[@]} -eq 0 ]; then  # the CPU path runs in the project's venv, which has everything
    $python -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$bundle"/wheels/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR=cuda
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$out"
timeout 540 $python scripts/bench/gpu_bench.py --data "$bundle/openmoji" --out "$out" "${cpu[@]}" "$@"
