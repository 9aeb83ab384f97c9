"""Run a function on 2 (or 4) CPU processes (gloo) and collect each rank's result.

The processes are started once per world size and kept for the whole test session (a pool): each
start is a new interpreter importing torch, the test module and what it imports (~8 s on 2 cores),
which every 2-rank test paid again. A call that fails on any rank (an exception, a collective that
times out, a rank that dies) retires the pool, and the next call starts a new one, so that one test's
broken process group is never another test's."""

from __future__ import annotations

import atexit
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank that waits longer in a collective fails its call


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, tasks, done) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    while True:
        try:
            task = tasks.get()
        except (EOFError, OSError):  # the test process is gone
            task = None
        if task is None:
            break
        fn, args, out_dir = task
        try:
            torch.save(fn(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
            done.put((rank, None))
        except BaseException:
            done.put((rank, traceback.format_exc()))
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: after the trainer's imports (accelerate, open_clip,
    # safetensors...) a spawned worker's teardown aborted in about 1 run in 8 ("terminate called without
    # an active exception", SIGABRT); processes started by `accelerate launch` never did.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Pool:
    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.done = ctx.Queue()
        port = _free_port()
        # not daemonic: a function may start processes of its own (DataLoader workers)
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, self.tasks[r], self.done))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, args: tuple, out_dir: str, timeout: float) -> None:
        for q in self.tasks:
            q.put((fn, args, out_dir))
        errors: dict[int, str | None] = {}
        deadline = time.time() + timeout
        while len(errors) < self.world:
            try:
                rank, error = self.done.get(timeout=2)
                errors[rank] = error
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in errors]
                if dead or time.time() > deadline:
                    silent = [r for r in range(self.world) if r not in errors]
                    said = "".join(f"\nrank {r} failed:\n{e}" for r, e in sorted(errors.items()) if e)
                    raise RuntimeError((f"rank(s) {dead} died" if dead else
                                        f"rank(s) {silent} gave no result within {timeout:.0f} s") + said) from None
        failed = {r: e for r, e in errors.items() if e}
        if failed:
            rank = min(failed)
            raise RuntimeError(f"rank {rank} of {self.world} failed:\n{failed[rank]}")

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


_pools: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def run_ranks(fn, args: tuple, tmp_path, world: int = 2, timeout: float = 600) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks (``fn`` importable: module level, and its
    arguments picklable); returns its results by rank."""
    pool = _pools.get(world)
    if pool is None:
        pool = _pools[world] = _Pool(world)
    try:
        pool.run(fn, args, str(tmp_path), timeout)
    except BaseException:
        _pools.pop(world, None)  # a failed call retires the pool: its process group may be broken
        pool.close()
        raise
    return [torch.load(os.path.join(str(tmp_path), f"rank{r}.pt"), weights_only=False) for r in range(world)]
