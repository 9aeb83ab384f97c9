#!/usr/bin/env bash
# CC3M end to end: img2dataset -> data_tools build/verify/embed -> accelerate launch -> eval -> export.
#
#   scripts/pretrain_cc3m.sh [options] [-- TRAIN_OVERRIDES...]
#
#   --tsv FILE             CC3M's Train_GCC-training.tsv (caption<TAB>url, no header) or, with
#                          --skip-download, a TSV with header "caption<TAB>image" of local image paths
#   --skip-download        build from the TSV's local images instead of running img2dataset
#   --data DIR             dataset folder to write (default data/cc3m)
#   --run DIR              run folder (default runs/cc3m)
#   --config FILE          training config (default configs/cc3m_clip_rn50.yaml)
#   --accelerate-config F  accelerate config (default configs/accelerate/8gpu.yaml; "none": one process)
#   --text-model ID        target encoder for data_tools embed (default sentence-transformers/all-MiniLM-L6-v2)
#   --image-size N         shorter side of the stored images (default 256)
#   --shard-size N         samples per built shard (default 1000; img2dataset's 10,000-sample tars are cut
#                          to it, so that CC3M's ~2.9M pairs give ~2,900 shards for many ranks x workers)
#   --eval SPEC            a zero-shot dataset (clip_benchmark wds folder, image folder, ...); repeatable
#   --workers N            build processes (default 8)
#
# Every step is resumable: build and embed skip finished shards, training resumes from the run folder.
# IMG2DATASET=PATH picks the img2dataset executable (`make img2dataset` installs one in its own venv,
# .cache/img2dataset/bin/img2dataset: it pins pandas<3, which this project's environment does not).
set -euo pipefail
tsv=Train_GCC-training.tsv; skip=0; data=data/cc3m; run=runs/cc3m; config=configs/cc3m_clip_rn50.yaml
acc=configs/accelerate/8gpu.yaml; text_model=sentence-transformers/all-MiniLM-L6-v2; size=256; workers=8
evals=(); python=${PYTHON:-python}; shard_size=1000; img2dataset=${IMG2DATASET:-img2dataset}
while [ $# -gt 0 ]; do
    case $1 in
        --tsv) tsv=$2; shift 2;;
        --skip-download) skip=1; shift;;
        --data) data=$2; shift 2;;
        --run) run=$2; shift 2;;
        --config) config=$2; shift 2;;
        --accelerate-config) acc=$2; shift 2;;
        --text-model) text_model=$2; shift 2;;
        --image-size) size=$2; shift 2;;
        --shard-size) shard_size=$2; shift 2;;
        --eval) evals+=("$2"); shift 2;;
        --workers) workers=$2; shift 2;;
        --) shift; break;;
        -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2;;
    esac
done
step() { echo "== $*" >&2; }

if [ "$skip" = 0 ]; then
    command -v "$img2dataset" >/dev/null || {
        echo "img2dataset not found ($img2dataset): make img2dataset, then IMG2DATASET=.cache/img2dataset/bin/img2dataset (or --skip-download)" >&2; exit 2; }
    raw="${data}_img2dataset"
    step "download $tsv -> $raw"
    with_header="${raw}.tsv"
    mkdir -p "$(dirname "$with_header")"
    { printf 'caption\turl\n'; cat "$tsv"; } > "$with_header"
    "$img2dataset" --url_list "$with_header" --input_format tsv --url_col url --caption_col caption \
        --output_format webdataset --output_folder "$raw" --processes_count "$workers" --thread_count 64 \
        --image_size "$size" --resize_mode keep_ratio --enable_wandb False
    src=$raw; build_args=()
else
    src=$tsv; build_args=(--image-column image --caption-column caption --base-dir "$(dirname "$tsv")")
fi
step "build $src -> $data"
"$python" -m data_tools build "$src" --out "$data" --image-size "$size" --shard-size "$shard_size" \
    --workers "$workers" "${build_args[@]}"
step "verify $data"
"$python" -m data_tools verify "$data"
step "embed $data with $text_model (sidecar files beside the shards; no shard is rewritten)"
"$python" -m data_tools embed "$data" --model "$text_model"
step "train $config -> $run"
if [ "$acc" = none ]; then
    "$python" -m mmpretrain.train --config "$config" "data.train=$data" "run_dir=$run" "$@"
else
    "$python" -m accelerate.commands.launch --config_file "$acc" -m mmpretrain.train --config "$config" \
        "data.train=$data" "run_dir=$run" "$@"
fi
for ds in "${evals[@]}"; do
    step "evaluate $run on $ds"
    "$python" -m mmpretrain.eval --model "$run" --dataset "$ds" --task zeroshot_classification \
        --output "$run/results.json"
done
step "export $run -> $run/export"
"$python" -m mmpretrain.export "$run" --out "$run/export" --overwrite  # a re-run replaces only its own export
echo "done: $run/export (push with: python -m mmpretrain.export $run --out $run/export --overwrite --push-to-hub ORG/NAME)" >&2
