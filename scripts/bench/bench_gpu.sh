#!/usr/bin/env bash
# The one GPU check, for a lent GPU machine without network (about 6 minutes on one H100/H200 by its
# measurements' estimates). Its time comes from the device's command limit (DEVICE_CALL_LIMIT_S, 600):
# 30 s kept to hand $OUT back, the install timed, then 45 s of grace for the last measurement; what is
# left is gpu_bench.py's --budget, and the outer timeout is the budget + 40 s. Here, first: `make gpu-bundle` (cp312 wheels of what
# the device image lacks + a small embedded dataset, ~20 MiB); then on the GPU machine, from the repository
# root, the bundle carried (the device tool's carry=[".cache/gpu-bundle"]):
#     scripts/bench/bench_gpu.sh [--bundle DIR] [--cpu] [-- GPU_BENCH_ARGS...]     (--cpu: the tiny CPU path)
# It installs the bundle's wheels into /tmp/mmpt-site (MMPT_SITE), only those whose distribution the
# machine's Python lacks (its own are never shadowed; each choice printed, the versions that ran in
# gpu.json), then runs scripts/bench/gpu_bench.py: our train_step against open_clip_train's (ViT-B-32
# bf16, samples/s, MFU), then whole steps from photo shards made there with data.decode=worker and
# =device against open_clip_train's loader; the tiled loss's memory at B = 65,536; bf16 agreement of every
# objective; FSDP/DeepSpeed train + resume (+ eval, export); k-means. Results: $OUT/gpu.json if OUT
# is set (the device tool's), else bench_results/gpu.json, rewritten after each measurement.
set -euo pipefail
SECONDS=0; limit=${DEVICE_CALL_LIMIT_S:-600}
cd "$(dirname "$0")/../.."
bundle=.cache/gpu-bundle; python=${PYTHON:-python3}; out=${OUT:-bench_results}; cpu=()
while [ $# -gt 0 ]; do
    case $1 in
        --bundle) bundle=$2; shift 2;;
        --cpu) cpu=(--device cpu --precision fp32 --model mmpt-tiny-vit --batch-size 16 --steps 1 --repeats 2
                    --e2e-steps 2 --e2e-images 64 --e2e-workers 1 --loss-batch 256 --precision-batch 128 --kmeans-rows 512 --kmeans-dim 32 --engines fsdp
                    --engine-wrapper tests/scripts/gpu_engine_on_cpu.py); shift;;
        --) shift; break;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2;;
    esac
done
[ -d "$bundle/wheels" ] && [ -d "$bundle/openmoji/train" ] || {
    echo "error: no bundle in $bundle (run \`make gpu-bundle\` where there is network, and carry it)" >&2; exit 2; }
[ ${#cpu[@]} -gt 0 ] || $python -c "import torch, sys; torch.cuda.is_available() or sys.exit('error: no CUDA device (--cpu runs the tiny CPU path)'); print('torch', torch.__version__, torch.cuda.get_device_name())"
site=${MMPT_SITE:-/tmp/mmpt-site}
# Only what the machine lacks: a bundle wheel whose distribution the machine's Python already has (any
# version) is left out, so nothing of the image's own is shadowed (typing_extensions, say). The target
# is emptied first, but only if this script made it (its marker).
if [ -e "$site" ] && [ ! -f "$site/.mmpt-site" ]; then
    echo "error: $site exists and was not made by this script; set MMPT_SITE to another folder" >&2; exit 2
fi
rm -rf "$site"; mkdir -p "$site"; touch "$site/.mmpt-site"
missing=$($python - "$bundle"/wheels/*.whl <<'PY'
import importlib.metadata as m, os, re, sys
need = []
for w in sys.argv[1:]:
    if not (w.endswith(".whl") and os.path.isfile(w)):  # an empty wheels/ leaves the glob itself
        continue
    name, version = os.path.basename(w).split("-")[:2]
    try:
        have = m.version(re.sub(r"[-_.]+", "-", name))
        print(f"kept the machine's {name} {have} (bundle: {version})", file=sys.stderr)
    except m.PackageNotFoundError:
        need.append(w)
        print(f"installing {name} {version} from the bundle", file=sys.stderr)
print("\n".join(need))
PY
)
if [ -n "$missing" ]; then
    mapfile -t wheels <<< "$missing"
    $python -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "${wheels[@]}"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" MMPT_SITE="$site"
[ ${#cpu[@]} -gt 0 ] || export DS_ACCELERATOR=cuda
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$out"
budget=$((limit - 30 - SECONDS - 45))
echo "install and start-up: ${SECONDS} s; budget ${budget} s of the ${limit} s command limit"
timeout -k 5 $((budget + 40)) $python scripts/bench/gpu_bench.py --data "$bundle/openmoji" --out "$out" \
    --budget "$budget" "${cpu[@]}" "$@"
