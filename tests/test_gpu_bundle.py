"""The GPU check's install path, here: a bundle built by scripts/bench/gpu_bundle.sh for this machine's
Python 3.11 (the device's cp312 wheels cannot install here, so this proves the install logic, not those
wheels) at the same pins, installed by scripts/bench/bench_gpu.sh into an empty target over a venv
holding only what the device image has that we use (torch, torchvision, accelerate, transformers,
scikit-learn, scikit-image, matplotlib, timm), then the script's imports and its --cpu path run from
there. Needs PyPI (the bundle's download; torch from this machine's wheels): make test-slow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

# what the device image ships, as far as this project uses it (the rest comes from the bundle)
IMAGE = ["torch", "torchvision", "accelerate", "transformers", "scikit-learn", "scikit-image", "matplotlib", "timm"]


@pytest.mark.slow  # a venv and a bundle from PyPI: minutes
def test_the_bundle_installs_only_what_an_image_lacks_and_the_check_runs_from_it(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/gpu_bundle.sh"), str(tmp_path / "bundle")], cwd=ROOT,
                       env={**env, "PYTHON": sys.executable, "BUNDLE_PYTHON": "3.11"},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    venv = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin/python")
    r = subprocess.run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-c",
                        str(ROOT / "constraints.txt"), *IMAGE], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    site = tmp_path / "site"
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/bench_gpu.sh"), "--bundle", str(tmp_path / "bundle"),
                        "--cpu", "--", "--sections", "step", "loss_memory", "precision"], cwd=ROOT,
                       env={**env, "PYTHON": py, "MMPT_SITE": str(site), "OUT": str(tmp_path / "out"),
                            "PYTHONPATH": ""}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    # the image's own packages are kept, not shadowed (torch brings typing_extensions; the bundle has one too)
    assert "kept the machine's typing_extensions" in r.stderr and not (site / "typing_extensions.py").exists()
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert installed and not installed & {"torch", "torchvision", "accelerate", "transformers", "timm"}
    result = json.loads((tmp_path / "out/gpu.json").read_text())
    v = result["versions"]
    assert v["torch"]["from"] == "machine" and v["open_clip_torch"]["from"] == "bundle", v
    assert v["webdataset"]["from"] == "bundle" and v["deepspeed"]["from"] == "bundle", v
    step = result["sections"]["step"]
    assert "error" not in step, step
    assert set(step["end_to_end"]["summary"]["samples_per_s"]) == {"ours_decode_worker", "ours_decode_device",
                                                                  "open_clip_train"}
    assert all("error" not in result["sections"][s] for s in ("loss_memory", "precision")), result["sections"]


@pytest.mark.slow  # the device image's versions from PyPI the first time (~3 GB), then ~2 min
@pytest.mark.skipif(not (shutil.which("python3.12") or list(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))),
                    reason="no Python 3.12 (the device image's) on this machine")
def test_the_check_runs_end_to_end_under_the_device_images_versions(tmp_path):
    """scripts/bench/gpu_rehearsal.sh: Python 3.12 with torch 2.11.0, torchvision 0.26.0, accelerate 1.15.0,
    transformers 5.17.0 (scripts/bench/device_image.txt), the real cp312 bundle installed over them by
    bench_gpu.sh, and every section's CPU path, the preflight included, without one error."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/gpu_bundle.sh"), str(tmp_path / "bundle")], cwd=ROOT,
                       env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/gpu_rehearsal.sh")], cwd=ROOT, capture_output=True,
                       text=True, timeout=3600, env={**env, "BUNDLE": str(tmp_path / "bundle"),
                                                     "OUT": str(tmp_path / "out")})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = json.loads((tmp_path / "out/gpu.json").read_text())
    v = out["versions"]
    assert v["torch"] == {"version": "2.11.0", "from": "machine"} and v["transformers"]["version"] == "5.17.0", v
    assert v["accelerate"]["version"] == "1.15.0" and v["open_clip_torch"]["from"] == "bundle", v
    assert all(line.startswith("ok: ") for line in out["preflight"].values()), out["preflight"]
    assert set(out["seconds"]) == {"loss_memory", "precision", "kmeans", "crop_stage", "step", "jpeg_faults", "engines"}
    assert "error: failed" not in r.stderr and not out["restarts"]
