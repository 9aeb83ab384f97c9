#!/usr/bin/env bash
# Multi-node pretraining under Slurm: one `accelerate launch` per node, GPUS_PER_NODE (8) GPUs each.
#
#   NODES=4 scripts/slurm_multinode.sh configs/cc3m_clip_rn50.yaml [TRAIN_OVERRIDES...]
#
# Run outside a job, it makes logs/ (Slurm opens --output before the job starts, so the folder must
# exist) and submits itself with sbatch --nodes $NODES (default 2; extra sbatch options in SBATCH_ARGS).
# `sbatch --nodes 4 scripts/slurm_multinode.sh CONFIG ...` works too once logs/ exists. Overrides are
# passed through word for word, e.g. "eval={every: 1000, datasets: [DIR]}".
#
# The first node of the allocation is the rendezvous host; data.train must be readable from every node
# (shared filesystem, or s3:// / hf:// urls with a sizes.json beside the shards). A requeued or restarted
# job resumes from run_dir's latest checkpoint by itself: rank 0 chooses it and every rank takes its
# choice (same nodes x GPUs needed for an exact resume). run_dir must be on a filesystem every node sees.
#SBATCH --job-name=mmpretrain
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: NODES=N $0 CONFIG [OVERRIDES...]   (or: sbatch --nodes N $0 CONFIG [OVERRIDES...])" >&2
    exit 2
fi
if [[ ! -f $1 ]]; then
    echo "error: $1: no such config file" >&2
    exit 2
fi
if [[ -z ${SLURM_JOB_ID:-} ]]; then
    mkdir -p logs
    # shellcheck disable=SC2086  # SBATCH_ARGS: several options, split on purpose
    exec sbatch --nodes "${NODES:-2}" ${SBATCH_ARGS:-} "$0" "$@"
fi
config=$1
shift
gpus=${GPUS_PER_NODE:-8}
nodes=${SLURM_NNODES:?run under sbatch}
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# srun no longer inherits --cpus-per-task from sbatch (Slurm >= 22.05): without it every rank's
# DataLoader workers share one core. SLURM_NODEID is read on each node (single quotes).
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-64}" bash -c '
    exec "${PYTHON:-python}" -m accelerate.commands.launch --multi_gpu --num_machines "$1" \
        --num_processes "$(($1 * $2))" --machine_rank "$SLURM_NODEID" --main_process_ip "$3" \
        --main_process_port "$4" --rdzv_backend static --mixed_precision bf16 \
        -m mmpretrain.train --config "${@:5}"' launch "$nodes" "$gpus" "$head" "$port" "$config" "$@"
