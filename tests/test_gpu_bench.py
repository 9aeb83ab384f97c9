"""scripts/gpu_bench.py (run by scripts/bench_gpu.sh on a lent GPU) runs its whole code path on the CPU
with the tiny model, so the script a GPU session gets once is not run for the first time there."""

import json
import subprocess
import sys

from conftest import ROOT


def test_gpu_bench_runs_on_cpu_with_the_tiny_model(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_bench.py"), "--out", str(tmp_path), "--device", "cpu",
                        "--precision", "fp32", "--model", "mmpt-tiny-vit", "--model-config-dir",
                        str(ROOT / "mmpretrain/model_configs"), "--batch-size", "8", "--steps", "1", "--repeats", "2",
                        "--loss-batch", "128"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert res["flops_per_step"] > 1e8 and len(res["runs"]) == 2 and res["ratio"] > 0
    assert set(res["samples_per_s"]) == {"open_clip_train", "ours"}
    assert {"ours_tiled", "open_clip"} <= set(res["loss_memory"])
    assert "bash" in (ROOT / "scripts/bench_gpu.sh").read_text().splitlines()[0]
