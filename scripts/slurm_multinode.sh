#!/usr/bin/env bash
# Multi-node pretraining under Slurm: one `accelerate launch` per node, 8 GPUs each.
#
#   sbatch --nodes 4 scripts/slurm_multinode.sh configs/cc3m_clip_rn50.yaml [TRAIN_OVERRIDES...]
#
# The first node of the allocation is the rendezvous host; data.train must be readable from every node
# (shared filesystem, or s3:// / hf:// urls with a sizes.json beside the shards). A requeued or restarted
# job resumes from run_dir's latest checkpoint by itself (same nodes x GPUs needed for an exact resume).
#SBATCH --job-name=mmpretrain
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
config=${1:?usage: sbatch --nodes N scripts/slurm_multinode.sh CONFIG [OVERRIDES...]}
shift
gpus=${GPUS_PER_NODE:-8}
nodes=${SLURM_NNODES:?run under sbatch/srun}
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
srun --kill-on-bad-exit=1 bash -c "python -m accelerate.commands.launch \
    --multi_gpu --num_machines $nodes --num_processes $((nodes * gpus)) --machine_rank \$SLURM_NODEID \
    --main_process_ip $head --main_process_port $port --rdzv_backend static --mixed_precision bf16 \
    -m mmpretrain.train --config $config $*"
