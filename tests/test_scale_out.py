"""Many ranks and several nodes, without the nodes: the stream plan at 64 GPUs x 8 workers, rank 0's
resume choice under per-node run folders, the checkpoint rename waiting for every rank's files, and
scripts/slurm_multinode.sh against fake Slurm commands."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmpretrain.data.plan import StreamPlan
from mmpretrain.data.sources import Source

from ddp_helpers import run_ranks

ROOT = Path(__file__).resolve().parent.parent


def test_cc3m_sized_plan_on_64_gpus_x_8_workers_reads_every_sample_once():
    """~330 img2dataset shards (CC3M: ~2.9M pairs at ~8,800 per shard, the last one short) for 512
    readers: more readers than shards is a valid plan (it was refused), every sample of an epoch is in
    exactly one reader's range but the stated remainder, readers' counts differ by at most one batch."""
    sizes = [8_800] * 329 + [4_321]
    sources = [Source("cc3m", [f"s3://bucket/cc3m/{i:05d}.tar" for i in range(len(sizes))], sizes)]
    plan = StreamPlan(sources, "epoch", 0, world_size=64, workers=8, batch_size=128,
                      num_samples=sum(sizes), shuffle_block=1000)
    assert plan.readers == 512 > len(plan.urls)
    for epoch in (0, 1):
        owner = {}
        for reader in range(plan.readers):
            main, spares = plan.reader_layout(epoch, reader)
            assert sum(s.stop - s.start for s in main) == plan.reader_length(epoch, reader % plan.workers)
            for seg in main + spares:
                for i in range(seg.start, seg.stop, 97):  # a sample every 97 (the full set is 2.9M)
                    assert owner.setdefault((seg.shard, i), reader) == reader, (seg, reader)
            assert all(plan.shards[s.shard].offset + s.stop <= plan.shards[s.shard].offset + plan.shards[s.shard].size
                       for s in main)
        # every position is covered: the ranges of all readers tile [0, ranks * steps * batch)
        covered = sum(s.stop - s.start for r in range(plan.readers) for s in plan.reader_layout(epoch, r)[0])
        assert covered == 64 * plan.steps_per_epoch * 128 == sum(sizes) - plan.dropped_per_epoch
        assert plan.dropped_per_epoch < 64 * 128  # less than one global batch
        counts = {plan.worker_batches(epoch, w) for w in range(plan.workers)}
        assert max(counts) - min(counts) <= 1
    assert plan.steps_per_epoch == sum(sizes) // (64 * 128)


@pytest.mark.parametrize("ranks,workers,batch", [(8, 10, 4096), (64, 8, 128), (2, 2, 8), (3, 7, 5)])
def test_an_epoch_drops_less_than_one_global_batch(ranks, workers, batch):
    """CC3M-sized (2.9M pairs), no I/O: every rank takes the same steps, worker w of a rank makes exactly
    its batches n with n % workers == w (the DataLoader's round robin) in every epoch, the readers' ranges
    tile the epoch without overlap, and the remainder is under one global batch (it was up to ranks x
    workers x batch - 1: 8 x 10 x 4,096 dropped 10% of CC3M an epoch)."""
    sizes = [8_800] * 329 + [4_321]
    plan = StreamPlan([Source("cc3m", [f"{i:05d}.tar" for i in range(len(sizes))], sizes)], "epoch", 0,
                      world_size=ranks, workers=workers, batch_size=batch, num_samples=sum(sizes), shuffle_block=0)
    G = ranks * batch
    assert plan.dropped_per_epoch == sum(sizes) - plan.steps_per_epoch * G < G
    if (ranks, workers, batch) == (8, 10, 4096):
        assert plan.dropped_per_epoch <= 32_768 and plan.steps_per_epoch == 88
    S = plan.steps_per_epoch
    for epoch in range(3):
        for w in range(workers):  # the rank's batches n of this epoch that come from worker w
            assert plan.worker_batches(epoch, w) == sum(1 for n in range(epoch * S, (epoch + 1) * S) if n % workers == w)
        assert plan.first_worker(epoch) == (epoch * S) % workers
        pos = 0  # main ranges in reader order tile [0, steps x global batch)
        for reader in range(plan.readers):
            main, _ = plan.reader_layout(epoch, reader)
            n = sum(s.stop - s.start for s in main)
            assert n == plan.reader_length(epoch, reader % workers) and n % batch == 0
            pos += n
        assert pos == S * G


def test_fewer_shards_than_readers_trains_with_a_note(openmoji, tmp_path):
    """9 training shards, 1 rank x 10 workers: trains (it was refused) and says why it reads more."""
    from conftest import train

    r = train(openmoji / "train", tmp_path / "run", "train.steps=1", "data.batch_size=8", "data.num_workers=10",
              "optim.warmup_steps=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "note: 10 readers (1 rank(s) x 10 worker(s)) share 9 shard(s)" in r.stderr


# ------------------------------------------------------------------ rank 0's resume choice


class _Acc:
    """What decide_resume and save_checkpoint use of an Accelerator, on a plain gloo process group."""

    distributed_type = "DistributedType.MULTI_CPU"

    def __init__(self, rank: int, world: int, delay: float = 0.0):
        self.process_index, self.num_processes, self.is_main_process = rank, world, rank == 0
        self.delay = delay

    def wait_for_everyone(self):
        if self.num_processes > 1:
            dist.barrier()

    def save_state(self, folder: str, safe_serialization: bool = True):
        """accelerate's layout: every rank its RNG file, the main process model and optimizer."""
        os.makedirs(folder, exist_ok=True)
        if self.process_index == 1:
            time.sleep(self.delay)  # a slow filesystem on one node
        if self.is_main_process:
            from safetensors.torch import save_file

            save_file({"clip.logit_scale": torch.zeros(())}, os.path.join(folder, "model.safetensors"))
            torch.save({}, os.path.join(folder, "optimizer.bin"))
        torch.save({}, os.path.join(folder, f"random_states_{self.process_index}.pkl"))


def _config(run_dir: Path):
    from mmpretrain.config import load_config

    return load_config(ROOT / "configs/demo.yaml", ["data.train=unused", f"run_dir={run_dir}"])


def _write_checkpoint(run_dir: Path, step: int, world: int) -> None:
    from mmpretrain.run_files import RunFolder
    from mmpretrain.train.checkpoint import save_checkpoint

    cfg = _config(run_dir)
    # written by one process for a world of `world` (every random_states_{r} file present)
    ckpt = save_checkpoint(_Acc(0, 1), RunFolder(run_dir), step, {"loader": [{}] * world, "samples": step,
                                                                  "config": cfg.model_dump(mode="json")})
    for r in range(world):
        torch.save({}, ckpt / f"random_states_{r}.pkl")


def _decide(rank, world, root):
    from mmpretrain.config import ConfigError
    from mmpretrain.run_files import RunFolder
    from mmpretrain.train.checkpoint import decide_resume

    run_dir = Path(root) / f"node{rank}"  # each node its own run folder (a node-local filesystem)
    try:
        ckpt, saved = decide_resume(_Acc(rank, world), _config(run_dir), RunFolder(run_dir))
        return {"ckpt": str(ckpt.relative_to(run_dir)) if ckpt else None, "step": saved and saved["step"]}
    except ConfigError as e:
        return {"error": str(e)}


@pytest.mark.parametrize("node0,node1,want", [
    ((3, 6), (3, 6), 6),
    ((3,), (3, 6), 3),  # node 1 sees a newer one: it still resumes where rank 0 does
    ((3, 6), (3,), None),  # node 1 lags: refused on every rank (it would have resumed from step 3)
])
def test_every_rank_resumes_from_rank_0s_choice_or_all_refuse(tmp_path, node0, node1, want):
    for node, steps in enumerate((node0, node1)):
        for step in steps:
            _write_checkpoint(tmp_path / f"node{node}", step, world=2)
    (tmp_path / "out").mkdir()
    out = run_ranks(_decide, (str(tmp_path),), tmp_path / "out", world=2)
    if want is None:
        assert all("rank 0 resumes from" in r["error"] and "rank(s) [1] do not see" in r["error"] for r in out), out
        assert "shares" in out[0]["error"]
    else:
        assert out == [{"ckpt": f"checkpoints/step_{want:08d}", "step": want}] * 2, out


def _save_with_a_slow_rank(rank, world, root):
    from mmpretrain.run_files import RunFolder
    from mmpretrain.train.checkpoint import save_checkpoint

    save_checkpoint(_Acc(rank, world, delay=1.5), RunFolder(Path(root)), 7, {"loader": [{}] * world, "samples": 7})
    return sorted(p.name for p in (Path(root) / "checkpoints").iterdir())


def test_the_checkpoint_is_renamed_after_every_rank_has_written(tmp_path):
    """Rank 1 writes its RNG state 1.5 s late: the folder is renamed only after (it was renamed at
    once, and rank 1 wrote into a new step_N.tmp that nothing cleans up or loads)."""
    (tmp_path / "out").mkdir()
    listings = run_ranks(_save_with_a_slow_rank, (str(tmp_path / "run"),), tmp_path / "out", world=2)
    assert listings == [["step_00000007"]] * 2
    ckpt = tmp_path / "run/checkpoints/step_00000007"
    assert {"random_states_0.pkl", "random_states_1.pkl", "train_state.json"} <= {p.name for p in ckpt.iterdir()}


# ------------------------------------------------------------------ Slurm


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    """sbatch, srun, scontrol and python on PATH that record their arguments (srun then runs its command)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = 'import json, os, sys; open(os.environ["CALLS"], "a").write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")'
    for name in ("sbatch", "python"):
        (bin_dir / name).write_text(f"#!{os.sys.executable}\n{record}\n")
    (bin_dir / "srun").write_text(f"#!{os.sys.executable}\n{record}\n"
                                  "args = sys.argv[1:]\nwhile args[0].startswith('--'):\n    args.pop(0)\n"
                                  "os.execvp(args[0], args)\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n")
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls.jsonl"),
            "PYTHON": str(bin_dir / "python")}


def _calls(tmp_path: Path) -> list[list[str]]:
    return [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_slurm_script_submits_itself_and_launches_one_accelerate_per_node(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | _fake_slurm(tmp_path)
    script, config = str(ROOT / "scripts/slurm_multinode.sh"), str(ROOT / "configs/cc3m_clip_rn50.yaml")
    overrides = ["train.steps=10", "eval={every: 3, datasets: [/data/imagenet val], tasks: [zeroshot_classification]}"]
    work = tmp_path / "work"
    work.mkdir()

    # outside a job: logs/ made (Slurm opens --output=logs/... before the job starts), then sbatch
    r = subprocess.run(["bash", script, config, *overrides], cwd=work, env=env | {"NODES": "4"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (work / "logs").is_dir()
    assert _calls(tmp_path) == [["sbatch", "--nodes", "4", script, config, *overrides]]

    # inside the job, on the second node: srun with the job's CPUs, accelerate with every override intact
    (tmp_path / "calls.jsonl").unlink()
    job = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
           "SLURM_CPUS_PER_TASK": "32", "SLURM_NODEID": "1"}
    r = subprocess.run(["bash", script, config, *overrides], cwd=work, env=env | job, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    srun, python = _calls(tmp_path)
    assert srun[:3] == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=32"]
    assert python == ["python", "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
                      "--num_processes", "16", "--machine_rank", "1", "--main_process_ip", "gpu-node-07",
                      "--main_process_port", "29500", "--rdzv_backend", "static", "--mixed_precision", "bf16",
                      "-m", "mmpretrain.train", "--config", config, *overrides]

    r = subprocess.run(["bash", script, "configs/nope.yaml"], cwd=work, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "configs/nope.yaml: no such config file" in r.stderr
