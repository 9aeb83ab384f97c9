"""One of 2 ranks dies (kill -9) mid-training: the other does not hang in a collective; the launch
exits with an error naming the failed rank within a bounded time."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import MICRO, ROOT, accelerate_launch


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_dead_rank_stops_the_run_with_an_error(openmoji, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [*accelerate_launch(), "-m", "mmpretrain.train", "--config",
           str(ROOT / "configs/demo.yaml"), f"data.train={openmoji / 'train'}", f"run_dir={run_dir}",
           "train.steps=500", "train.epochs=null", "data.batch_size=8", "data.num_workers=1", "train.save_every=2",
           "optim.warmup_steps=1", "train.progress=false", "train.log_with=[]", "train.plots=false", *MICRO]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (run_dir / "checkpoints/step_00000002").is_dir() and p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert p.poll() is None, "the run ended before the fault"
        workers = [c for c in _children(p.pid) if "mmpretrain.train" in _cmdline(c)]
        assert len(workers) == 2, workers
        victim = max(workers)
        os.kill(victim, signal.SIGKILL)
        t0 = time.time()
        _, err = p.communicate(timeout=120)
        elapsed = time.time() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode != 0
    assert elapsed < 60, f"the surviving rank took {elapsed:.0f} s to stop"
    assert "exitcode" in err and ("-9" in err or "SIGKILL" in err), err[-2000:]
    # the checkpoint written before the fault is complete and is what a restart resumes from
    assert (run_dir / "checkpoints/step_00000002/train_state.json").is_file()
