#!/usr/bin/env bash
# Builds what scripts/bench/bench_gpu.sh needs on a GPU machine without network (`make gpu-bundle`):
#   DIR/wheels/    cp312 wheels of the runtime dependencies such a machine may lack (its image has torch,
#                  accelerate, transformers, timm, scikit-learn...; not open_clip, webdataset, pydantic,
#                  deepspeed), at the versions this project is tested with here (bench_gpu.sh installs
#                  only those the machine has no version of); deepspeed as a wheel
#                  built here without compiled ops (pure Python; DS_ACCELERATOR picks CUDA there)
#   DIR/openmoji/  1,200 OpenMoji emoji at 64 px in 128-sample shards with their MiniLM caption
#                  embeddings (the text encoder itself, 90 MB, stays here), train/ and test/
# Everything together stays under the device's 64 MiB carry limit (checked).
#
#   scripts/bench/gpu_bundle.sh [DIR]        (default .cache/gpu-bundle; needs `make setup` and PyPI access;
#                                             BUNDLE_PYTHON=3.11: wheels for another Python)
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.cache/gpu-bundle}; py=${PYTHON:-.venv/bin/python}
pyver=${BUNDLE_PYTHON:-3.12}  # the device image's Python (tests/test_gpu_bundle.py builds a 3.11 one for this machine)
[ -x "$py" ] || { echo "error: $py not found: run make setup first" >&2; exit 2; }
# replaces only a bundle it wrote itself (its marker file), never another folder
for d in "$dir" "$dir.partial"; do
    if [ -e "$d" ] && [ ! -f "$d/.mmpt-gpu-bundle" ]; then
        echo "error: $d exists and is not a bundle this script wrote; pick another DIR or remove it" >&2; exit 2
    fi
done
tmp="$dir.partial"; rm -rf "$tmp"; mkdir -p "$tmp/wheels"; touch "$tmp/.mmpt-gpu-bundle"
# the versions installed here (what the tests ran), so the device runs the same code
pins=$($py - <<'PY'
import importlib.metadata as m
names = ["open_clip_torch", "ftfy", "wcwidth", "webdataset", "braceexpand", "pydantic", "pydantic_core",
         "annotated_types", "typing_inspection", "typing_extensions",
         "pandas", "python_dateutil", "six"]  # open_clip_train.data (the end-to-end anchor) imports pandas
print(" ".join(f"{n}=={m.version(n)}" for n in names))
PY
)
$py -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$tmp/wheels" $pins hjson==3.1.0 ninja==1.13.2 msgpack==1.2.4 \
    py-cpuinfo==9.0.0 einops==0.8.2  # deepspeed's requirements, at make deepspeed's pins (accelerate imports it)
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu $py -m pip wheel --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -w "$tmp/wheels" deepspeed==0.19.8
HF_HUB_OFFLINE=1 $py -m data_tools build demo:openmoji --out "$tmp/openmoji" --image-size 64 --shard-size 128 \
    --limit 1200 > /dev/null
HF_HUB_OFFLINE=1 $py -m data_tools embed "$tmp/openmoji" --model sentence-transformers/all-MiniLM-L6-v2 > /dev/null
size=$(du -sm "$tmp" | cut -f1)
[ "$size" -lt 60 ] || { echo "error: the bundle is $size MiB, over the device's 64 MiB carry limit" >&2; exit 1; }
rm -rf "$dir"; mv "$tmp" "$dir"
echo "$dir: $size MiB ($(ls "$dir/wheels" | wc -l) wheels; the dataset in $dir/openmoji)"
