"""Host memory of the loader: batches built in shared memory, data.prefetch_factor, and the start-of-run
check that /dev/shm can hold what the loaders will put there."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from mmpretrain.data import host_memory
from mmpretrain.data.batch import collate

from conftest import SHORT, train


def test_host_memory_formula_at_4096_per_gpu():
    # one 4,096-sample batch at 224 px with 77 int64 tokens and a 384-d embedding
    b = host_memory.batch_bytes(4096, 224, context=77, emb_dim=384)
    assert b == 4096 * (3 * 224 * 224 + 8 * 77 + 4 * 384) and round(b / 2**20) == 596
    # 8 ranks x (8 workers x prefetch 2 + 2) batches: what an 8-GPU node's /dev/shm must hold
    assert host_memory.shm_bytes(b, workers=8, prefetch_factor=2, local_ranks=8) == 8 * 18 * b
    assert host_memory.shm_bytes(b, workers=0, prefetch_factor=2) == 0  # no workers: no hand-over
    assert not host_memory.pin(b) and host_memory.pin(host_memory.batch_bytes(128, 224, 77))


def test_a_full_shm_is_refused_with_the_fixes(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=r"--shm-size=\d+g .*data.prefetch_factor, data.num_workers or data.batch_size"):
        host_memory.check_shm(free + 2**30, 2**20, 8, 2, 1, path=str(tmp_path))
    host_memory.check_shm(free // 2, 2**20, 8, 2, 1, path=str(tmp_path))  # fits: no error


class _Items(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        items = [{"image": torch.randint(0, 255, (3, 8, 8), dtype=torch.uint8, generator=g), "text": "a",
                  "key": str(i), "index": i, "emb": torch.randn(5, generator=g)} for i in range(4)]
        batch = collate(items)
        yield {"shared": (batch.images.is_shared(), batch.target_embeddings.is_shared()),
               "equal": torch.equal(batch.images, torch.stack([it["image"] for it in items]))}


def test_a_worker_stacks_the_batch_into_shared_memory():
    """In a worker the batch is stacked straight into shared memory (no private copy to move there)."""
    out = next(iter(DataLoader(_Items(), batch_size=None, num_workers=1)))
    assert out["shared"] == [True, True] and out["equal"]
    assert not collate([{"image": torch.zeros(3, 2, 2), "text": "a", "key": "k", "index": 0}]).images.is_shared()


def test_the_trainer_refuses_a_shm_too_small_before_training(openmoji, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=64 * 2**20)
                        if str(p) == host_memory.SHM else real(p))
    r = train(openmoji / "train", tmp_path / "run", *SHORT, "train.steps=2", "data.batch_size=256",
              "data.num_workers=2", "data.prefetch_factor=64")
    assert r.returncode == 2, r.stderr
    assert "/dev/shm has 0.06 GiB free" in r.stderr and "--shm-size=" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
