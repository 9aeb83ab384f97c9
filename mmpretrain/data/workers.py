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
after an ``all_gather_object``, hung so in 3 of 150 runs here; 9 of 3,000 such loader starts did
(scripts/bench/bench_worker_start.py), 0 of 3,000 from the fork server.

So: ``fork`` in a process without a process group; under one, a fork server -- a process started by
exec (safe from any thread) that imports the workers' modules once and forks each worker from its one
thread. What a worker runs then travels pickled (the dataset object; the shards are read by the
worker), and the modules its objects come from are preloaded by the server. As with ``spawn``, a
script run by path (``python my_script.py``, not ``-m``) that starts workers under a process group
needs the ``if __name__ == "__main__":`` guard: each worker imports the script.

A fork server stays up while any process it started may still use it (each holds its "alive" pipe),
and a DataLoader worker stops when its parent -- the server -- is gone: a rank killed outright (OOM,
SIGKILL) would leave both waiting on each other forever, holding the launcher's output pipes. So every
worker starts with :func:`worker_init`, which closes its end of that pipe: when the rank dies the
server exits, and its workers follow (torch's parent check, within 5 s)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from functools import partial

import torch.distributed as dist

_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None))


def modules_needed(*objects, limit: int = 64) -> list[str]:
    """The loaded modules that ``objects`` and what they hold (attributes, container items -- the first
    ``limit`` of each container -- and a partial's function and arguments) come from: what a worker
    imports to receive them."""
    names: set[str] = set()
    seen: set[int] = set()
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if isinstance(obj, _LEAVES) or id(obj) in seen:
            continue
        seen.add(id(obj))
        module = getattr(obj if isinstance(obj, type) or callable(obj) else type(obj), "__module__", None)
        if isinstance(module, str):
            names.add(module)
        if isinstance(obj, type):
            continue
        if isinstance(obj, dict):
            stack += [x for kv in list(obj.items())[:limit] for x in kv]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)[:limit]
        elif isinstance(obj, partial):
            stack += [obj.func, *obj.args, *obj.keywords.values()]
        else:
            stack += list(getattr(obj, "__dict__", {}).values())[:limit]
    return sorted(m for m in names if not m.startswith("__") and m in sys.modules)


def start_method(*objects) -> str | None:
    """The multiprocessing start method for workers that receive ``objects`` (``multiprocessing_context``
    of a DataLoader, ``multiprocessing.get_context`` of a pool); start the workers with
    :func:`worker_init`. ``None``: the platform's default (spawn on macOS and Windows). Under a process
    group the fork server's preload is set from ``objects`` and the server started, once per process."""
    if sys.platform != "linux":
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return "fork"
    multiprocessing.set_forkserver_preload(["torch", *modules_needed(*objects)])
    # started now (by exec; it imports in the background) rather than at the loader's first batch: the
    # training loader is made before the model is wrapped and the checkpoint restored
    multiprocessing.forkserver.ensure_running()
    return "forkserver"


def _init(then, *args) -> None:
    server = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:  # a worker never starts processes of its own: let the server see its owner go
        try:
            os.close(alive)
        except OSError:
            pass
        server._forkserver_alive_fd = None
    if then is not None:
        then(*args)


def worker_init(then=None):
    """A worker's first call (a DataLoader's ``worker_init_fn``, a pool's ``initializer``): closes the
    worker's end of the fork server's alive pipe (see the module's doc), then calls ``then(*args)``."""
    return partial(_init, then)


def loader_workers(num_workers: int, *objects, then=None) -> dict:
    """A DataLoader's worker arguments: ``num_workers``, the start method for workers that receive
    ``objects`` and :func:`worker_init` (then ``then(worker_id)``); in-process loading for 0."""
    if not num_workers:
        return {"num_workers": 0}
    init = worker_init(then)
    return {"num_workers": num_workers, "multiprocessing_context": start_method(*objects, init),
            "worker_init_fn": init}
