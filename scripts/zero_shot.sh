#!/usr/bin/env bash
# Zero-shot classification and retrieval of one model on several datasets, one results.json.
#
#   scripts/zero_shot.sh MODEL OUT.json DATASET [DATASET ...]
#
# MODEL: a run folder, an export folder, local-dir:DIR, hf-hub:ID, or an open_clip architecture (then set
# PRETRAINED=tag). A DATASET is classification when it has class names (clip_benchmark's wds layout with
# classnames.txt, an image folder, shards with classnames) and retrieval otherwise (dataset_type.txt says
# retrieval, or captions only). NPROC=N splits the images over N processes with accelerate launch
# (ACCELERATE_CONFIG picks the config; default: accelerate's own). Extra flags: EVAL_ARGS="--batch_size 512".
#
# Example (the demo's held-out split, then clip_benchmark's CIFAR-10 export if you have it):
#   scripts/zero_shot.sh runs/demo runs/demo/results.json data/openmoji ~/wds/cifar10
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
model=$1; out=$2; shift 2
python=${PYTHON:-python}
launch=("$python" -m)
if [ "${NPROC:-1}" -gt 1 ]; then
    launch=("$python" -m accelerate.commands.launch --num_processes "$NPROC" ${ACCELERATE_CONFIG:+--config_file "$ACCELERATE_CONFIG"} -m)
fi
# one evaluation call for every dataset: the model is loaded (and, with NPROC, the processes started) once
tasks=()
for ds in "$@"; do
    root=${ds#*:}
    task=zeroshot_classification
    if [ -f "$root/dataset_type.txt" ] && grep -qi retrieval "$root/dataset_type.txt"; then
        task=zeroshot_retrieval
    elif [ -f "$root/test/nshards.txt" ] && [ ! -f "$root/classnames.txt" ]; then
        task=zeroshot_retrieval
    fi
    echo "== $ds: $task" >&2
    tasks+=("$task")
done
"${launch[@]}" mmpretrain.eval --model "$model" ${PRETRAINED:+--pretrained "$PRETRAINED"} \
    --dataset "$@" --task "${tasks[@]}" --output "$out" ${EVAL_ARGS:-}
echo "results: $out" >&2
