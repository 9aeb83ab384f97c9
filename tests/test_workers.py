"""How worker processes start (mmpretrain/data/workers.py): forked from a process without a process
group; under one, from a fork server, never from the rank itself (whose backend threads can hold the
interpreter's thread-list lock at the instant of a fork: the child then waits forever, gh-112275)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from mmpretrain.data.workers import loader_workers, modules_needed, start_method

from ddp_helpers import run_ranks


class _ParentPid(IterableDataset):
    """Yields the worker's parent process id and its end of the fork server's alive pipe."""

    def __iter__(self):
        import multiprocessing.forkserver

        yield os.getppid(), multiprocessing.forkserver._forkserver._forkserver_alive_fd


def _after_a_collective(rank, world):
    """What a rank's DataLoader does straight after an all_gather_object (evaluation's pattern)."""
    out = [None] * world
    dist.all_gather_object(out, rank)
    ds = _ParentPid()
    method = start_method(ds)
    import multiprocessing.forkserver as fs

    preload = list(fs._forkserver._preload_modules)
    seen = list(DataLoader(ds, batch_size=None, **loader_workers(2, ds)))
    return {"method": method, "preload": preload, "pid": os.getpid(), "parents": [p for p, _ in seen],
            "alive_fds": [fd for _, fd in seen], "gathered": out}


def test_workers_fork_without_a_process_group_and_come_from_a_fork_server_under_one(tmp_path):
    ds = _ParentPid()
    assert start_method(ds) == "fork"
    assert [p for p, _ in DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork")] == [os.getpid()]
    for rank, got in enumerate(run_ranks(_after_a_collective, (), tmp_path, world=2)):
        assert got["gathered"] == [0, 1]
        assert got["method"] == "forkserver", got
        assert "torch" in got["preload"] and __name__ in got["preload"], got["preload"]
        # two workers, both children of the server, neither of the rank
        assert len(got["parents"]) == 2 and got["pid"] not in got["parents"], (rank, got)
        assert len(set(got["parents"])) == 1, got
        # each worker closed its end of the server's alive pipe: a rank killed outright takes its server
        # and workers with it (tests/reliability/test_rank_failure.py)
        assert got["alive_fds"] == [None, None], got


def test_the_preload_is_the_modules_the_workers_objects_come_from(openmoji):
    from mmpretrain.eval.context import _collate, _Share
    from mmpretrain.eval.datasets import load_dataset
    from mmpretrain.models.from_disk import load_model

    _, preprocess, _ = load_model("mmpt-tiny-vit", device="cpu")
    share = _Share(load_dataset(str(openmoji / "test")), preprocess, 0, 1, False)
    names = modules_needed(share, _collate)
    for m in ("mmpretrain.eval.context", "mmpretrain.eval.datasets", "open_clip.transform",
              "torchvision.transforms.transforms"):
        assert m in names, names
    assert not any(m.startswith("__") for m in names) and not any(m.startswith("mmpretrain.train") for m in names)
    assert "torch" in modules_needed(torch.zeros(3))
