"""How worker processes start (DataLoader workers, the data tools' pools): ``fork`` where it is safe, a
fork server where it is not.

``fork`` is the fast way on Linux (nothing re-imported, the dataset shared copy-on-write) and torch's
default. It copies only the forking thread, so it is safe only when no other thread holds a lock the
child needs at that instant. A process group breaks that: after each collective the backend's thread
(gloo's run loop, seen here; NCCL's work cleanup likewise) drops the Python tensors the work held, and
to do so creates a Python thread state without holding the GIL, taking the interpreter's thread-list
lock. A fork at that instant leaves the child waiting on that lock forever in CPython before 3.11.10
and 3.12.1 (gh-112275, also backported to 3.10 and 3.9 late) -- the 3.11.7 this project is tested on,
and the interpreter of many clusters. Evaluation on 2 gloo ranks, which starts a DataLoader straight
after an ``all_gather_object``, hung so in 3 of 150 runs here; 8 of 3,000 such loader starts did
(scripts/bench/bench_worker_start.py), 0 of 3,000 from the fork server.

So: ``fork`` in a process without a process group; under one, a fork server -- a process started by
exec (safe from any thread) that imports the workers' modules once and forks each worker from its one
thread. What a worker runs then travels pickled (the dataset object; the shards are read by the
worker), and the modules it needs are those the pickle names, preloaded by the server. As with
``spawn``, a script run by path (``python my_script.py``, not ``-m``) that starts workers under a
process group needs the ``if __name__ == "__main__":`` guard: each worker imports the script."""

from __future__ import annotations

import io
import multiprocessing
import pickle
import sys

import torch.distributed as dist


class _Modules(pickle.Pickler):
    """A pickler that records the module of every class, function and object it writes."""

    def __init__(self):
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.names: set[str] = set()

    def reducer_override(self, obj):
        module = getattr(obj if isinstance(obj, type) or callable(obj) else type(obj), "__module__", None)
        if isinstance(module, str):
            self.names.add(module)
        return NotImplemented


def modules_needed(*objects) -> list[str]:
    """The importable modules the pickles of ``objects`` name (what a worker must import to receive them)."""
    p = _Modules()
    for obj in objects:
        p.dump(obj)
    return sorted(m for m in p.names if not m.startswith("__") and m in sys.modules)


def start_method(*objects) -> str | None:
    """The multiprocessing start method for workers that receive ``objects`` (``multiprocessing_context``
    of a DataLoader, ``multiprocessing.get_context`` of a pool). ``None``: the platform's default (spawn
    on macOS and Windows). Under a process group the fork server's preload is set from ``objects``
    (read when this process first starts a worker)."""
    if sys.platform != "linux":
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return "fork"
    multiprocessing.set_forkserver_preload(["torch", *modules_needed(*objects)])
    return "forkserver"
