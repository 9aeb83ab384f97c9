"""scripts/bench/bench_gpu.sh (the one command a lent GPU machine runs) on its CPU path: every section of
scripts/bench/gpu_bench.py with the tiny model, so the script a GPU session gets once is not run for the
first time there. The bundle it carries is built by `make gpu-bundle` (PyPI access); here its dataset
is the test's own OpenMoji build and it has no wheels (the CPU path runs in the project's venv)."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import ROOT

DEEPSPEED = ROOT / ".cache/deepspeed"


def bundle(openmoji: Path, tmp_path: Path) -> Path:
    b = tmp_path / "bundle"
    (b / "wheels").mkdir(parents=True)
    (b / "openmoji").symlink_to(openmoji)
    return b


def bench(tmp_path: Path, openmoji: Path, *extra: str, env: dict | None = None, rc: int = 0) -> dict:
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/bench_gpu.sh"), "--bundle", str(bundle(openmoji, tmp_path)),
                        "--cpu", *extra], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), **(env or {})})
    assert r.returncode == rc, (r.stdout + r.stderr)[-4000:]
    out = json.loads((tmp_path / "out/gpu.json").read_text())
    out["stderr"] = r.stderr
    return out


@pytest.mark.slow  # ~90 s; the sections' pieces are tested on their own (test_precision, test_regions, test_engines)
def test_gpu_check_rehearsal_with_a_fault_in_the_end_to_end_path(openmoji, tmp_path):
    """The whole check on the CPU, the device side of the end-to-end steps made to fail and the JPEG probe
    made to poison its process's context: it exits 1 naming both, and everything else -- the fixed-batch
    step figures, the other end-to-end sides, every later section -- is in gpu.json with its time."""
    from conftest import script

    gb = script("scripts/bench/gpu_bench.py")
    fault = "step.end_to_end.ours_decode_device"
    out = bench(tmp_path, openmoji, "--", "--fault", fault, "--fault", "jpeg_faults:context", rc=1)
    assert f"error: failed: {fault}, jpeg_faults (the rest measured" in out["stderr"] or \
        f"error: failed: jpeg_faults, {fault} (the rest measured" in out["stderr"], out["stderr"][-2000:]
    res = out["sections"]
    assert res["jpeg_faults"]["error"].startswith("RuntimeError: CUDA error: context fault injected")
    assert out["versions"]["torch"]["from"] == "machine" and out["versions"]["open_clip_torch"]["version"]
    assert set(out["seconds"]) == set(gb.SECTIONS) and all(v is not None for v in out["seconds"].values())
    assert all(v.startswith("ok: ") for v in out["preflight"].values()), out["preflight"]
    step = res["step"]["fixed_batch"]
    assert set(step["samples_per_s"]) == {"open_clip_train", "ours"} and len(step["blocks"]) == 2
    # ours trims the text padding the open_clip step runs: fewer FLOPs on the same batch
    assert 0 < step["flops_per_step"]["ours"] < step["flops_per_step"]["open_clip_train"]
    assert step["text_length_used"] <= step["tokens_ours"] < step["tokens_open_clip"] == 32
    nothing = {"syncs c10 reports": None, "pageable copies": None}  # a CPU has nothing to sync with
    assert step["syncs_per_step"] == {"open_clip_train": nothing, "ours": nothing}
    e2e = res["step"]["end_to_end"]
    assert e2e["ours_decode_device"]["error"] == f"RuntimeError: fault injected at {fault} (--fault)"
    assert e2e["ours_decode_device"]["traceback"]
    for side in ("ours_decode_worker", "open_clip_train"):  # the other sides measured all the same
        s = e2e[side]
        assert s["samples_per_s"] > 0 and s["timed_steps"] == 2 and s["warmup_steps"] == 3 and s["seconds"] > 0
        assert s["step_ms"]["p10"] <= s["step_ms"]["median"] <= s["step_ms"]["p90"] and 0 <= s["data_wait_share"] < 1
        assert s["flops_per_step"] > 0
    assert e2e["ours_decode_worker"]["epochs"] == [0]  # warm-up, timed and counted steps in one epoch
    oc = e2e["open_clip_train"]
    assert oc["batches_used"] <= oc["epoch_batches"]
    # each side's own FLOPs: open_clip runs the full-length text
    assert e2e["open_clip_train"]["flops_per_step"] > e2e["ours_decode_worker"]["flops_per_step"]
    assert set(e2e["summary"]["samples_per_s"]) == {"ours_decode_worker", "open_clip_train"}
    assert e2e["photos"]["images"] >= (3 + 1 + 2 + 5) * 16
    mem = res["loss_memory"]
    assert mem["loss_rel_diff"] < 1e-5 and mem["ours_tiled"]["grad_norm"] == pytest.approx(mem["open_clip"]["grad_norm"], rel=1e-5)
    assert len(res["precision"]["cases"]) == 16 and res["precision"]["max_grad_rel"] < 0.03
    assert res["precision"]["tf32"] == {"matmul": False, "cudnn": False}  # against true fp32
    for row in res["kmeans"]["scales"].values():  # same warm start, same Lloyd: the same optimum
        assert row["torch"]["warm_inertia"] == pytest.approx(row["sklearn"]["warm_inertia"], rel=1e-3)
        assert row["torch_repeatable"]
    fsdp = res["engines"]["fsdp"]
    assert fsdp["ok"] and fsdp["resume"]["resumed"] and sorted(map(int, fsdp["losses"])) == list(range(1, 9))
    assert fsdp["resume"]["logged_steps"] == list(range(1, 9)) and {6, 8} <= set(fsdp["resume"]["checkpoints"])
    assert "open_clip_model.safetensors" in fsdp["export_files"] and fsdp["acc1"] is not None
    assert "2 gloo ranks" in fsdp["sharding"]


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
                env={"PYTHONPATH": f"{DEEPSPEED}:{os.environ.get('PYTHONPATH', '')}", "DS_ACCELERATOR": "cpu"})["sections"]
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


def test_the_recorder_keeps_every_measurement_and_writes_each_at_once(tmp_path):
    """A failing measurement is its own result (error + the traceback's last frames); the ones before and
    after it stand, and gpu.json holds each as soon as it exists; --fault makes a named one fail."""
    from conftest import script

    gb = script("scripts/bench/gpu_bench.py")
    path = tmp_path / "gpu.json"
    rec = gb.Recorder({"sections": {}}, path, faults=["step.end_to_end.c"])
    rec.run("step", "fixed_batch", lambda: {"samples_per_s": 1.0})
    assert json.loads(path.read_text())["sections"]["step"]["fixed_batch"]["samples_per_s"] == 1.0
    rec.run("step", "end_to_end.a", lambda: 1 / 0)
    rec.run("step", "end_to_end.b", lambda: {"ok": True})
    rec.run("step", "end_to_end.c", lambda: {"ok": True})
    got = json.loads(path.read_text())["sections"]["step"]
    assert got["end_to_end"]["a"]["error"] == "ZeroDivisionError: division by zero"
    assert "in <lambda>" in got["end_to_end"]["a"]["traceback"][-1]
    assert got["end_to_end"]["b"]["ok"] and got["fixed_batch"]["samples_per_s"] == 1.0
    assert got["end_to_end"]["c"]["error"].startswith("RuntimeError: fault injected at step.end_to_end.c")
    assert rec.failed == ["step.end_to_end.a", "step.end_to_end.c"]


@pytest.mark.parametrize("batch,workers,steps", [(256, 8, 100), (16, 1, 2), (64, 3, 7)])
def test_end_to_end_windows_stay_in_one_epoch(batch, workers, steps):
    """The photos hold warm-up (two full prefetch rounds of every worker) + timed + sync-count steps in
    whole batches per worker: no side's window reaches an epoch boundary."""
    from conftest import script

    e2e = script("scripts/bench/gpu_end_to_end.py")  # standalone: it imports gpu_common, not gpu_bench
    n = e2e.images_needed(batch, workers, steps)
    used = e2e.warmup_steps(workers) + steps + e2e.SYNC_STEPS  # the first warm-up step counts the FLOPs
    assert e2e.warmup_steps(workers) >= 2 * workers * e2e.PREFETCH
    assert n // batch >= used and n % (batch * workers) == 0
    assert e2e.images_needed(batch, workers, steps, at_least=100 * n) >= 100 * n


def test_resume_is_read_from_the_log_and_the_checkpoints(tmp_path):
    from conftest import script

    gb = script("scripts/bench/gpu_engines.py")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (3, 6, 8):
        (run / f"checkpoints/step_{step:08d}").mkdir()
        (run / f"checkpoints/step_{step:08d}/train_state.json").write_text("{}")
    lines = [{"step": s, "loss": 1.0} for s in range(1, 9)] + [{"step": 8, "final": True}]
    (run / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert gb.resumed_from_files(run, 6, 8)["resumed"]
    restarted = [{"step": s, "loss": 1.0} for s in [*range(1, 7), *range(1, 9)]]  # began again at step 1
    (run / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in restarted))
    assert not gb.resumed_from_files(run, 6, 8)["resumed"]


def test_each_side_gets_its_own_mfu():
    from conftest import script

    script("scripts/bench/gpu_bench.py")
    e2e = script("scripts/bench/gpu_end_to_end.py")
    sides = {"ours_decode_worker": {"samples_per_s": 100.0, "flops_per_step": 2e12},
             "ours_decode_device": {"error": "RuntimeError: x"},
             "open_clip_train": {"samples_per_s": 50.0, "flops_per_step": 3e12}}
    out = e2e.summary(sides, 10, 1.0)
    assert out["mfu"] == {"ours_decode_worker": 20.0, "open_clip_train": 15.0}
    assert out["ours_decode_worker_over_open_clip"] == 2.0 and "device_over_worker" not in out


@pytest.mark.integration  # starts a process
def test_a_fault_that_names_no_measurement_is_refused(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts/bench/gpu_bench.py"), "--data", str(tmp_path),
                        "--fault", "step.end_to_end.device"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "names no measurement" in r.stderr and "step.end_to_end.ours_decode_device" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "scripts/bench/gpu_bench.py"), "--data", str(tmp_path),
                        "--fault", "kmeans:stall"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and ":hang" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "scripts/bench/gpu_bench.py"), "--data", str(tmp_path),
                        "--watchdog", "kmean=5"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--watchdog kmean=5" in r.stderr, r.stderr


@pytest.mark.integration  # starts processes: ~35 s
def test_a_crash_a_poisoned_context_and_a_hang_each_cost_one_measurement(openmoji, tmp_path):
    """Three measurements of the in-process group fail the three ways a GPU can take a process down -- a
    segfault, a sticky context error, a hang -- and the one after them is measured all the same: the
    supervisor records each (the hang with the stack the watchdog dumped) and starts a fresh worker."""
    out = bench(tmp_path, openmoji, "--", "--sections", "loss_memory", "precision", "kmeans", "crop_stage",
                "--fault", "loss_memory:crash", "--fault", "precision:context", "--fault", "kmeans:hang",
                "--watchdog", "kmeans=5", rc=1)
    res = out["sections"]
    assert "error: failed: loss_memory, precision, kmeans (the rest measured" in out["stderr"], out["stderr"][-2000:]
    assert res["loss_memory"]["error"].startswith("the worker process ended (signal SIGSEGV)")
    assert any("Segmentation fault" in line for line in res["loss_memory"]["stack"])
    assert res["precision"]["error"].startswith("RuntimeError: CUDA error: context fault injected")
    assert res["kmeans"]["error"].startswith("hung: no result within its 5 s limit")
    assert any("in inject" in line for line in res["kmeans"]["stack"]), res["kmeans"]["stack"]
    assert "error" not in res["crop_stage"] and res["crop_stage"]["batched"]["diff_max"] <= 8
    assert len(out["restarts"]) == 3 and out["plan"] == [["loss_memory", "precision", "kmeans", "crop_stage"]]


def test_the_estimates_fit_the_budget_with_a_fifth_to_spare():
    """The default plan (7 cold launches in engines) by the estimates, worker starts and preflight
    included, against the budget bench_gpu.sh derives from the device's 600 s command limit."""
    from conftest import script

    gb = script("scripts/bench/gpu_bench.py")
    args = gb.parse(["--data", "x"])
    assert sum(len(gb.STAGES[e]) for e in args.engines) == 7
    assert gb.estimate(args) <= 0.8 * gb.BUDGET_S
    assert gb.BUDGET_S == 600 - 30 - 15 - 45  # hand-back, install, grace (bench_gpu.sh)


@pytest.mark.integration  # starts processes: ~15 s
def test_the_outer_timeout_takes_the_worker_with_the_supervisor(openmoji, tmp_path):
    """bench_gpu.sh's `timeout` signals the supervisor only; the worker runs in its own session, so the
    supervisor kills it on SIGTERM instead of leaving it to hold the device past the command. The signal
    goes to `timeout` once the worker hangs (what its alarm does), not after a fixed time that a loaded
    machine may not reach the hang in."""
    out = tmp_path / "unique-out"
    proc = subprocess.Popen(["timeout", "600", sys.executable, str(ROOT / "scripts/bench/gpu_bench.py"), "--data",
                             str(openmoji), "--out", str(out), "--device", "cpu", "--precision", "fp32", "--model",
                             "mmpt-tiny-vit", "--sections", "kmeans", "--fault", "kmeans:hang", "--watchdog",
                             "300"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines, hanging = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "kmeans: hanging" in line:
                hanging.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert hanging.wait(240), "".join(lines)[-2000:]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(60)
    assert rc == 124 and not reader.is_alive(), "".join(lines)[-2000:]  # nothing holds the pipe
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


@pytest.mark.integration  # starts a process
def test_the_rehearsal_never_replaces_a_folder_it_did_not_make(tmp_path):
    """gpu_rehearsal.sh rebuilds its venv with rm -rf only where its marker says it made it: a user's
    folder given as VENV is refused whole, its file kept."""
    venv = tmp_path / "mine"
    venv.mkdir()
    (venv / "notes.txt").write_text("keep me")
    r = subprocess.run(["bash", str(ROOT / "scripts/bench/gpu_rehearsal.sh"), str(venv)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "was not made by this script" in r.stderr, r.stderr
    assert (venv / "notes.txt").read_text() == "keep me"
