"""scripts/bench/bench_gpu.sh (the one command a lent GPU machine runs) on its CPU path: every section of
scripts/bench/gpu_bench.py with the tiny model, so the script a GPU session gets once is not run for the
first time there. The bundle it carries is built by `make gpu-bundle` (PyPI access); here its dataset
is the test's own OpenMoji build and it has no wheels (the CPU path runs in the project's venv)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

DEEPSPEED = ROOT / ".cache/deepspeed"


def bundle(openmoji: Path, tmp_path: Path) -> Path:
    b = tmp_path / "bundle"
    (b / "wheels").mkdir(parents=True)
    (b / "openmoji").symlink_to(openmoji)
    return b


def bench(tmp_path: Path, openmoji: Path, *extra: str, env: dict | None = None) -> dict:
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/bench_gpu.sh"), "--bundle", str(bundle(openmoji, tmp_path)),
                        "--cpu", *extra], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), **(env or {})})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads((tmp_path / "out/gpu.json").read_text())["sections"]


@pytest.mark.slow  # ~65 s; the sections' pieces are tested on their own (test_precision, test_regions, test_engines)
def test_gpu_bench_cpu_path_runs_every_section(openmoji, tmp_path):
    res = bench(tmp_path, openmoji)
    versions = json.loads((tmp_path / "out/gpu.json").read_text())["versions"]
    assert versions["torch"]["from"] == "machine" and versions["open_clip_torch"]["version"]
    step = res["step"]
    assert set(step["samples_per_s"]) == {"open_clip_train", "ours"} and len(step["blocks"]) == 2
    # ours trims the text padding the open_clip step runs: fewer FLOPs on the same batch
    assert 0 < step["flops_per_step"]["ours"] < step["flops_per_step"]["open_clip_train"]
    assert step["text_length_used"] <= step["tokens_ours"] < step["tokens_open_clip"] == 32
    e2e = step["end_to_end"]  # whole steps from photo shards made by the script: both decode paths, and open_clip's
    assert set(e2e["samples_per_s"]) == {"ours_decode_worker", "ours_decode_device", "open_clip_train"}
    assert all(v > 0 for v in e2e["samples_per_s"].values()) and e2e["images"] >= 64
    mem = res["loss_memory"]
    assert mem["loss_rel_diff"] < 1e-5 and mem["ours_tiled"]["grad_norm"] == pytest.approx(mem["open_clip"]["grad_norm"], rel=1e-5)
    assert len(res["precision"]["cases"]) == 16 and res["precision"]["max_grad_rel"] < 0.03
    for row in res["kmeans"]["scales"].values():  # same warm start, same Lloyd: the same optimum
        assert row["torch"]["warm_inertia"] == pytest.approx(row["sklearn"]["warm_inertia"], rel=1e-3)
        assert row["torch_repeatable"]
    fsdp = res["engines"]["fsdp"]
    assert fsdp["ok"] and fsdp["resume"]["resumed"] and sorted(map(int, fsdp["losses"])) == list(range(1, 9))
    assert "open_clip_model.safetensors" in fsdp["export_files"] and fsdp["acc1"] is not None


@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_bench_gpu_refuses_a_missing_bundle_and_a_machine_without_cuda(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/bench_gpu.sh"), "--bundle", str(tmp_path / "nope")],
                       capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 2 and "make gpu-bundle" in r.stderr
    (tmp_path / "b/wheels").mkdir(parents=True)
    (tmp_path / "b/openmoji/train").mkdir(parents=True)
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/bench_gpu.sh"), "--bundle", str(tmp_path / "b")],
                       capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode != 0 and "no CUDA device" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not (DEEPSPEED / "deepspeed").is_dir(), reason="make deepspeed installs it (make test-slow)")
def test_gpu_bench_engine_smoke_ddp_and_deepspeed_on_cpu(openmoji, tmp_path):
    res = bench(tmp_path, openmoji, "--", "--sections", "engines", "--engines", "ddp", "deepspeed",
                env={"PYTHONPATH": f"{DEEPSPEED}:{os.environ.get('PYTHONPATH', '')}", "DS_ACCELERATOR": "cpu"})
    for engine in ("ddp", "deepspeed"):
        assert res["engines"][engine]["ok"], res["engines"][engine]


def test_gpu_bundle_replaces_only_a_bundle_it_wrote(tmp_path):
    """gpu_bundle.sh removes DIR and DIR.partial before writing them: a folder of the user's under either
    name is refused before anything (download included) happens, its files kept."""
    for target in (tmp_path / "a", tmp_path / "b.partial"):
        target.mkdir()
        (target / "keep.txt").write_text("mine")
        r = subprocess.run(["bash", str(ROOT / "scripts/bench/gpu_bundle.sh"), str(target).removesuffix(".partial")],
                           capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=60)
        assert r.returncode == 2 and "not a bundle this script wrote" in r.stderr
        assert (target / "keep.txt").read_text() == "mine"


@pytest.mark.integration  # starts a process
def test_bench_gpu_never_empties_a_site_folder_it_did_not_make(tmp_path):
    """bench_gpu.sh empties its install target before installing: a folder of the user's under that
    name (MMPT_SITE) is refused before anything happens, its files kept."""
    (tmp_path / "b/wheels").mkdir(parents=True)
    (tmp_path / "b/openmoji/train").mkdir(parents=True)
    site = tmp_path / "mine"
    site.mkdir()
    (site / "keep.txt").write_text("mine")
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/bench_gpu.sh"), "--bundle", str(tmp_path / "b"), "--cpu"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": sys.executable, "MMPT_SITE": str(site), "OUT": str(tmp_path / "o")})
    assert r.returncode == 2 and "was not made by this script" in r.stderr and "MMPT_SITE" in r.stderr
    assert (site / "keep.txt").read_text() == "mine" and not (tmp_path / "o").exists()


def test_the_jpeg_faults_section_holds_the_rule_on_the_cpu():
    """The GPU check's jpeg_faults section on torchvision's CPU decoder (libjpeg): the cut JPEGs decode to
    grey and are counted as truncated_jpeg, the broken one raises and is undecodable_image, the photo kept.
    On CUDA the same section says what nvJPEG does with them."""
    import argparse

    import torch

    from conftest import script

    res = script("scripts/bench/gpu_bench.py").jpeg_faults_section(argparse.Namespace(), torch.device("cpu"))
    assert res["rule_holds"], res
    assert res["cut, ends in EOI"]["device decode_jpeg"] == "pixels, last block grey: True"
    assert res["broken Huffman tables"]["device decode_jpeg"].startswith("raised")


def test_the_crop_stage_section_runs_on_the_cpu():
    """The GPU check's crop_stage section (per-image against batched crops, timed on the device) on 16 photos
    on the CPU: both pixel differences within the device tests' tolerances."""
    import argparse

    import torch

    from conftest import script

    res = script("scripts/bench/gpu_bench.py").crop_stage_section(argparse.Namespace(), torch.device("cpu"), n=16)
    assert res["nvjpeg_backend"] == "n/a" and res["device_decode_failures"] == 0, res
    assert res["batched"]["diff_mean"] < 0.25 and res["batched"]["diff_max"] <= 8, res
    assert res["per_image"]["diff_mean"] < 0.5 and res["per_image"]["diff_max"] <= 16, res
