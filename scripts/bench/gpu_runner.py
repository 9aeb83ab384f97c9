"""How the GPU check runs its measurements (scripts/bench/gpu_bench.py is the command): a supervisor that
never measures, and worker processes that do, one group of measurements each, in the plan's order.

- **Isolation.** A group is one process: the cheap in-process measurements share one; the JPEG fault
  probe (nvJPEG can leave a sticky CUDA error), the end-to-end sides (loader workers) and the engine
  launches each get their own. A worker whose measurement failed checks its context (:func:`healthy`)
  and exits if it is poisoned; the supervisor starts a fresh worker for the rest of the group.
- **Watchdog.** Every measurement runs under ``faulthandler.dump_traceback_later(limit, exit=True)``: a
  hang dumps every thread's stack into ``stacks/KEY.txt`` and ends the worker, and the supervisor
  writes that stack into gpu.json as the measurement's error, then goes on with the next one. A crash
  (segfault, abort) is recorded the same way. The supervisor kills the worker's whole process group
  afterwards (loader workers, launches).
- **Budget.** Before each measurement the worker skips it if its estimate would end past the deadline.
- **Faults** (``--fault KEY[:KIND]``, the rehearsal's injections): ``raise`` (default), ``hang``,
  ``crash`` (SIGSEGV) and ``context`` (on CUDA a device-side assert, a real sticky error; on a CPU every
  later torch call in the process raises, as after one).
gpu.json is written by whichever process holds it (one at a time), replaced whole after each result."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FAULT_KINDS = ("raise", "hang", "crash", "context")
POISONED = 3  # a worker's exit status after a measurement left its context unusable


def save(result: dict, path: Path) -> None:
    """gpu.json, replaced whole (a run cut short keeps what it finished)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def lookup(result: dict, key: str):
    node = result.get("sections", {})
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class Recorder:
    """gpu.json as it grows: each measurement's result -- or its error with the traceback's last frames
    -- is written the moment it exists. ``faults``: ``KEY[:KIND]`` each, the measurements that fail on purpose."""

    def __init__(self, result: dict, path: Path, faults: list[str] | str | None = None):
        self.result, self.path, self.failed = result, path, []
        faults = [faults] if isinstance(faults, str) else faults or []
        self.faults = {k: kind or "raise" for k, _, kind in (f.partition(":") for f in faults)}

    def put(self, section: str, name: str | None, value: dict) -> dict:
        node = self.result["sections"].setdefault(section, {})
        if name is None:
            node.update(value)
        else:
            *parents, leaf = name.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        save(self.result, self.path)
        return value

    def run(self, section: str, name: str | None, fn, *a, **kw) -> dict:
        key = f"{section}.{name}" if name else section
        t0 = time.perf_counter()
        try:
            if key in self.faults:
                inject(self.faults[key], key)
            out = fn(*a, **kw)
            out = out if isinstance(out, dict) else {"value": out}
        except Exception as e:  # the error is the result; the other measurements go on
            import traceback

            traceback.print_exc()
            frames = traceback.extract_tb(e.__traceback__)[-4:]
            out = {"error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": [f"{Path(f.filename).name}:{f.lineno} in {f.name}: {f.line}" for f in frames]}
            self.failed.append(key)
        out["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{key}: {'FAILED, ' if 'error' in out else ''}{out['seconds']} s -> {self.path}", flush=True)
        return self.put(section, name, out)


# ------------------------------------------------------------------------------------------- injections

def inject(kind: str, key: str) -> None:
    import torch

    if kind == "hang":
        print(f"{key}: hanging (--fault {key}:hang)", flush=True)
        while True:
            time.sleep(1)
    if kind == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == "context":
        if torch.cuda.is_available():  # an out-of-range index: a device-side assert, sticky for the process
            x = torch.zeros(2, device="cuda")
            x[torch.tensor([5], device="cuda")] += 1
            torch.cuda.synchronize()
        else:
            poison_torch()
        raise RuntimeError(f"CUDA error: context fault injected at {key} (--fault)")
    raise RuntimeError(f"fault injected at {key} (--fault)")


def poison_torch() -> None:
    """On a CPU, what a sticky CUDA error does to a process: every later torch call raises."""
    from torch.overrides import TorchFunctionMode

    class Poisoned(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            raise RuntimeError("CUDA error: device-side assert triggered (injected; the context is unusable)")

    Poisoned().__enter__()  # never left: the process is done for


def healthy() -> bool:
    """Whether this process can still run torch on its device (a sticky CUDA error says no)."""
    import torch

    try:
        x = torch.ones(4, device="cuda" if torch.cuda.is_available() else "cpu")
        float((x + 1).sum())
        return True
    except Exception:
        return False


# ------------------------------------------------------------------------------------------------ worker

def watched(rec: Recorder, key: str, limit: float, stacks: Path, current: Path, fn, *a) -> dict:
    """``fn`` as measurement ``key`` under the watchdog: past ``limit`` seconds every thread's stack goes
    to ``stacks/KEY.txt`` and the process exits (the supervisor records it and goes on)."""
    section, _, name = key.partition(".")
    stacks.mkdir(parents=True, exist_ok=True)
    current.write_text(json.dumps({"key": key, "limit_s": round(limit)}))
    with open(stacks / f"{key}.txt", "w") as f:
        faulthandler.enable(file=f, all_threads=True)
        faulthandler.dump_traceback_later(limit, exit=True, file=f)
        try:
            return rec.run(section, name or None, fn, *a)
        finally:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.enable(file=sys.stderr, all_threads=True)


# -------------------------------------------------------------------------------------------- supervisor

def supervise(groups: list[list[str]], worker_cmd, path: Path, work: Path, limits: dict[str, float],
              notes: list[str]) -> list[str]:
    """Runs each group's keys in a worker (``worker_cmd(keys)`` gives its command line) until every key has
    a result; a worker that dies mid-measurement gets that measurement recorded as failed (its stack) and
    a fresh worker takes the rest. Returns the keys that failed.

    The outer ``timeout`` signals this process only; the worker runs in its own session and goes with it.
    One SIGTERM handler covers the whole run (a gap between workers with SIG_DFL would leave a worker
    behind), SIGTERM is held back while a worker starts (so the handler always knows it), and the handler
    does not wait() (the wait it interrupts may hold Popen's lock)."""
    workers: list[subprocess.Popen] = []

    def on_term(*_):
        for proc in workers:
            signal_group(proc, signal.SIGKILL)
        raise SystemExit(124)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return [k for group in groups for k in run_group(group, worker_cmd, path, work, limits, notes, workers)]
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_group(group: list[str], worker_cmd, path: Path, work: Path, limits: dict[str, float],
              notes: list[str], workers: list[subprocess.Popen]) -> list[str]:
    failed: list[str] = []
    current = work / "current.json"
    todo = list(group)
    while todo:
        current.unlink(missing_ok=True)
        cmd = worker_cmd(todo)
        budget = sum(limits[k] for k in todo) + 60
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            workers[:] = [subprocess.Popen(cmd, start_new_session=True)]
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        proc = workers[0]
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            rc = None
        kill_group(proc)
        workers.clear()
        result = json.loads(path.read_text())
        done = [k for k in todo if lookup(result, k) is not None]
        failed += [k for k in done if isinstance(lookup(result, k), dict) and "error" in lookup(result, k)]
        todo = [k for k in todo if k not in done]
        if not todo:
            break
        if rc == POISONED:
            notes.append(f"a fresh process after {done[-1] if done else '?'} left the context unusable")
            continue
        key = json.loads(current.read_text())["key"] if current.exists() else todo[0]
        stack = (work / "stacks" / f"{key}.txt")
        lines = stack.read_text().splitlines() if stack.exists() else []
        hung = any(line.startswith("Timeout (") for line in lines)
        why = (f"hung: no result within its {limits[key]:.0f} s limit (watchdog; the stack below)" if hung
               else f"the worker process ended ({describe_exit(rc)}) during this measurement")
        record_failure(path, key, why, lines[-40:], limits[key] if hung else None)
        failed.append(key)
        notes.append(f"{key}: {why.split(':')[0]}; a fresh process took the rest of its group")
        todo = [k for k in todo if k != key]
    return failed


def record_failure(path: Path, key: str, why: str, stack: list[str], seconds: float | None) -> None:
    result = json.loads(path.read_text())
    node = result["sections"]
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = {"error": why, "stack": stack, "seconds": seconds}
    save(result, path)
    print(f"{key}: FAILED ({why})", flush=True)


def describe_exit(rc: int | None) -> str:
    if rc is None:
        return "killed by the supervisor past its group's limit"
    if rc < 0:
        return f"signal {signal.Signals(-rc).name}"
    return f"exit status {rc}"


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(proc: subprocess.Popen) -> None:
    """The worker and everything it started (loader workers, launches), whatever state it is in."""
    signal_group(proc, signal.SIGKILL)
    proc.wait()
