"""The trainer: exact resume (weights and loss log bit for bit on CPU), non-finite losses handled as
configured, checkpoints kept as configured, configs that change a checkpoint's training refused."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mmpretrain.losses.base import Objective
from mmpretrain.losses.clip import ClipLoss

from conftest import ROOT, accelerate_launch, setup_run, train

# tensorboard on: the resume test checks its events
COMMON = ["train.steps=6", "data.batch_size=16", "data.num_workers=2", "data.shuffle_buffer=32", "optim.warmup_steps=2",
          "train.log_every=1", "train.save_every=3", "train.keep_last=2", "train.log_with=[tensorboard]"]


def _train(openmoji, run_dir, *extra):
    return train(openmoji / "train", run_dir, *COMMON, *extra)


def _losses(run_dir):
    return [{k: v for k, v in r.items() if k.endswith("_loss") or k in ("step", "loss", "lr", "logit_scale")}
            for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())]


def test_resume_after_a_crash_equals_the_uninterrupted_run(openmoji, tmp_path):
    a = tmp_path / "a"
    evals = f"eval={{every: 3, datasets: [{openmoji}], tasks: [zeroshot_classification], num_workers: 0}}"
    r = _train(openmoji, a, evals, "train.diagnostics_every=2", "train.plots=true")
    assert r.returncode == 0, r.stderr[-3000:]
    # observability: diagnostics every 2 steps, evaluations at 3 and 6, plots, tensorboard events
    records = [json.loads(x) for x in (a / "log.jsonl").read_text().splitlines()]
    geo = [r["step"] for r in records if "geometry/align" in r]
    assert geo == [2, 4, 6] and all(0 <= r["geometry/align"] <= 4 for r in records if "geometry/align" in r)
    assert [r["step"] for r in records if any(k.startswith("eval/") for k in r)] == [3, 6]
    # the wait for data, as open_clip's data_time: seconds per step, and the share of the interval
    steps = [r for r in records if "loss" in r]
    assert steps and all(r["data_time"] >= 0 and 0 <= r["data_wait_fraction"] <= 1 for r in steps)
    assert any(r["data_time"] > 0 for r in steps)
    results = json.loads((a / "results.json").read_text())["results"]
    assert [e["model"] for e in results] == ["step_3", "step_6"]
    assert {p.name for p in (a / "plots").iterdir()} >= {"loss.png", "lr_scale.png", "geometry.png", "similarity.png"}
    assert list((a / "mmpretrain").rglob("events.out.tfevents.*"))
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    state = json.loads((a / "checkpoints/step_00000003/train_state.json").read_text())
    assert state["loader"][0]["batches"] == 3 and state["step"] == 3

    # the same run killed after step 5 was logged, before its final checkpoint (a half-written one left)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints/step_00000006")
    (b / "checkpoints/step_00000006.tmp").mkdir()
    log = (b / "log.jsonl").read_text().splitlines()
    (b / "log.jsonl").write_text("\n".join(log[:5]) + "\n")
    r = _train(openmoji, b)  # resumes from the run folder's latest checkpoint (evaluations may change)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step 3" in r.stderr
    wa = load_file(a / "checkpoints/step_00000006/model.safetensors")
    wb = load_file(b / "checkpoints/step_00000006/model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    la = [x for x in _losses(a) if "loss" in x]
    lb = [x for x in _losses(b) if "loss" in x]
    assert la == lb and [x["step"] for x in la] == [1, 2, 3, 4, 5, 6]  # bit-identical floats, each step once

    # a changed objective is refused
    r = _train(openmoji, b, "loss.1.weight=0.25")
    assert r.returncode == 2 and "loss" in r.stderr and "different config" in r.stderr


class _NanAt:
    """The run's objective, with a non-finite loss at one step."""

    def __init__(self, objective, step, run):
        self.objective, self.step, self.run = objective, step, run

    def __getattr__(self, name):  # what the objective declares (needs, state_dict, ...)
        return getattr(self.objective, name)

    def __call__(self, **kw):
        out = self.objective(**kw)
        if self.run.state.step == self.step:
            out = {k: v * float("nan") if k.endswith("_loss") else v for k, v in out.items()}
        return out


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_nonfinite_loss_is_handled_as_configured(openmoji, tmp_path, mode):
    from mmpretrain.train import fit

    run = setup_run(openmoji / "train", tmp_path / mode, *COMMON, "train.save_every=1", "data.num_workers=0",
                    f"train.nonfinite={mode}", "train.steps=4")
    run.objective = _NanAt(run.objective, 2, run)
    ckpts = tmp_path / mode / "checkpoints"
    if mode == "stop":
        with pytest.raises(FloatingPointError, match="non-finite loss at step 2 .*clip_loss=nan"):
            fit(run)
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000002"]  # none after
    else:
        fit(run)
        log = [json.loads(x) for x in (tmp_path / mode / "log.jsonl").read_text().splitlines()]
        assert [r["nonfinite_steps"] for r in log] == [0, 0, 1, 1]
        w = load_file(ckpts / "step_00000004/model.safetensors")
        assert all(torch.isfinite(v).all() for v in w.values())


STEP_SCRIPT = str(ROOT / "tests/scripts/step_equivalence.py")


@pytest.fixture(scope="module")
def one_process_steps():
    """``which -> results`` of the step script in one process (this one; run once per ``which``)."""
    import importlib.util

    from conftest import reset_process_state

    spec = importlib.util.spec_from_file_location("step_equivalence", STEP_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    done = {}

    def steps(which: str) -> dict:
        if which not in done:
            reset_process_state()
            done[which] = json.loads(json.dumps(script.main(None, which)))
            reset_process_state()
            for name, res in done[which].items():  # gradient caching is the whole batch's step
                if name.startswith("grad_cache"):
                    whole = done[which][name.replace("grad_cache", "whole")]
                    assert res["losses"] == pytest.approx(whole["losses"], rel=1e-9), name
        return done[which]

    return steps


@pytest.fixture
def launched_steps(request, tmp_path):
    """``(world, which) -> results`` of the step script on ``world`` gloo ranks under accelerate launch:
    2 ranks from the session's one ``ddp_checks`` launch, 4 from a launch of its own (make test-slow)."""
    import subprocess

    def steps(world: int, which: str) -> dict:
        if (world, which) == (2, "default"):
            return request.getfixturevalue("ddp_checks")["steps"]
        out = tmp_path / f"{world}.json"
        r = subprocess.run([*accelerate_launch(), "--num_processes", str(world),
                            STEP_SCRIPT, str(out), which], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(out.read_text())

    return steps


# 4 ranks is in make test-slow (~75 s, over the ~60 s a make-test test may take): 2 ranks here; every
# objective is also tested on 2 gloo ranks in value and gradient (test_losses.py)
@pytest.mark.parametrize("world,which", [(2, "default"), pytest.param(4, "default", marks=pytest.mark.slow),
                                         pytest.param(4, "all", marks=pytest.mark.slow)])
@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_processes_equal_one_with_the_same_global_batch(one_process_steps, launched_steps, world, which):
    """5 float64 steps through train_step with the global batch split over ``world`` gloo ranks under
    accelerate launch: the losses and weights of one process, with and without gradient caching; on 4
    ranks (``make test-slow``) also 3 steps of every objective alone (clip's gather modes and tiling, sigmoid with and without
    within-view negatives, soft targets in image space, cwcl, vrn, align_uniform, global_clip)."""
    a, b = one_process_steps(which), launched_steps(world, which)
    assert len(b) == (22 if which == "all" else 2)
    for name in b:
        assert len(a[name]["losses"]) == (5 if "/" not in name else 3)
        assert b[name]["losses"] == pytest.approx(a[name]["losses"], rel=1e-6, abs=1e-6), name
        assert b[name]["weights"] == pytest.approx(a[name]["weights"], rel=1e-9), name


@pytest.mark.slow
def test_pretrain_cc3m_script_on_a_local_tsv(openmoji, tmp_path):
    """scripts/pretrain_cc3m.sh --skip-download: build -> verify -> embed -> train -> eval -> export."""
    import os
    import subprocess
    import sys

    from data_copies import extract_images

    rows = ["caption\timage"] + [f"{caption}\timages/{name}"
                                  for caption, name in extract_images(openmoji, 2, tmp_path / "images")]
    (tmp_path / "pairs.tsv").write_text("\n".join(rows) + "\n")
    run = tmp_path / "run"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts/pretrain_cc3m.sh"), "--skip-download", "--tsv", str(tmp_path / "pairs.tsv"),
         "--data", str(tmp_path / "data"), "--run", str(run), "--config", str(ROOT / "configs/tiny/soft_target.yaml"),
         "--accelerate-config", "none", "--image-size", "32", "--workers", "1", "--eval", str(openmoji), "--",
         "train.steps=2", "train.epochs=null", "data.batch_size=16", "data.num_workers=1", "data.shuffle_buffer=0",
         "optim.warmup_steps=1", "train.progress=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads((tmp_path / "data/manifest.json").read_text())["embedding"]["model"]
    assert json.loads((run / "results.json").read_text())["results"][0]["task"] == "zeroshot_classification"
    assert (run / "export/open_clip_model.safetensors").is_file()


def test_hub_push_uses_the_api_and_never_exposes_the_token(openmoji, tmp_path, monkeypatch, capsys):
    """Periodic checkpoint push during training and the export's push, through huggingface_hub (patched:
    there is no network); the token is read by huggingface_hub from the environment, never by us."""
    import huggingface_hub

    from mmpretrain.export.cli import main as export_main
    from mmpretrain.train import fit

    secret = "hf_" + "x" * 30
    monkeypatch.setenv("HF_TOKEN", secret)
    calls = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.append(("create", repo_id, kw)))

    def upload(**kw):
        calls.append(("upload", kw["repo_id"], kw))
        return type("Info", (), {"commit_url": f"https://huggingface.co/{kw['repo_id']}/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "upload_folder", upload)
    monkeypatch.setattr("mmpretrain.train.run_setup.offline", lambda: False)  # the patched Hub is "online"
    run_dir = tmp_path / "run"
    fit(setup_run(openmoji / "train", run_dir, *COMMON, "data.num_workers=0", "train.steps=4", "train.save_every=2",
                  "hub={repo_id: me/tiny, push_every: 2, revision: dev}"))
    uploads = [c for c in calls if c[0] == "upload"]
    assert [c[2]["path_in_repo"] for c in uploads] == ["checkpoints/step_00000002", "checkpoints/step_00000004"]
    assert all(c[1] == "me/tiny" and c[2]["revision"] == "dev" for c in uploads)
    calls.clear()
    out = tmp_path / "export"
    assert export_main([str(run_dir), "--out", str(out), "--push-to-hub", "me/tiny", "--private",
                        "--revision", "v1"]) == 0
    assert calls[0] == ("create", "me/tiny", {"private": True, "exist_ok": True})
    assert calls[1][2]["folder_path"] == str(out) and calls[1][2]["revision"] == "v1"
    printed = capsys.readouterr()
    assert secret not in printed.out + printed.err
    for f in [*run_dir.rglob("*"), *out.rglob("*")]:
        if f.is_file() and f.suffix in (".json", ".yaml", ".md", ".jsonl", ".txt"):
            assert secret not in f.read_text(errors="ignore"), f
    # both folders start a new run: model.pretrained=<run folder> (its latest checkpoint) or an export
    trained = load_file(run_dir / "checkpoints/step_00000004/model.safetensors")
    for source in (run_dir, out):
        run2 = setup_run(openmoji / "train", tmp_path / ("from_" + source.name), *COMMON, "data.num_workers=0",
                         f"model.pretrained={source}")
        state = run2.accelerator.unwrap_model(run2.model).state_dict()
        for k in ("clip.visual.conv1.weight", "clip.logit_scale", "clip.text.proj.weight"):
            assert torch.equal(state[k], trained[k]), (source, k)


def test_region_weighting_trains_logs_and_resumes_exactly(openmoji, tmp_path):
    """The region-weighted objective in the trainer: per-scale diagnostics (purity from the shards'
    labels) in the log, bank/centroids/weights in the checkpoint, and a resume bit-identical to the
    uninterrupted run (the Hedge weights and the bank restored, not restarted)."""
    # regions from the frozen caption embeddings: populated from the first step (a 2-step-old image
    # tower puts every sample in one region, where the Hedge weights have nothing to move)
    regions = ("loss=[{name: regions, options: {base: clip, scales: [2, 4], bank_size: 48, refresh_every: 2, "
               "warmup_steps: 2, space: target}}]")
    a = tmp_path / "a"
    r = _train(openmoji, a, regions)
    assert r.returncode == 0, r.stderr[-3000:]
    # the start line and config.yaml state the largest matrix a step builds: the 16 x 16 logits
    assert "note: regions builds at most 256 elements per matrix on a rank" in r.stderr
    assert yaml.safe_load((a / "config.yaml").read_text())["resolved"]["largest_matrix"] == 256
    records = [json.loads(x) for x in (a / "log.jsonl").read_text().splitlines()]
    assert [r["regions/active"] for r in records] == [0, 0, 1, 1, 1, 1]  # warm-up: global term only
    assert all(r["regions_loss"] == r["regions/global"] for r in records[:2])
    last = records[-1]
    assert sum(last["regions/m4/sizes"]) == 16 and 0 < last["regions/m4/purity"] <= 1
    # the weights moved off uniform (q_max first order in the move; the entropy only second order)
    assert last["regions/m4/q_max"] - 0.25 > 1e-6 and last["regions/m4/q_entropy"] < math.log(4)
    assert (a / "checkpoints/step_00000003/objective.safetensors").is_file()
    assert not list(a.rglob("custom_checkpoint_*"))  # no pickled objects

    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints/step_00000006")
    (b / "log.jsonl").write_text("\n".join((a / "log.jsonl").read_text().splitlines()[:3]) + "\n")
    r = _train(openmoji, b, regions)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 3" in r.stderr
    assert _losses(a) == _losses(b)
    sa = load_file(a / "checkpoints/step_00000006/objective.safetensors")
    sb = load_file(b / "checkpoints/step_00000006/objective.safetensors")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class _Recording(Objective):
    """CLIP that records the step context the trainer passes (it declares labels and sample indices)."""

    needs = frozenset({"labels", "sample_index"})
    calls: list[dict] = []

    def __init__(self, *, rank=0, world_size=1, chunk_size=None):
        super().__init__()
        self.clip = ClipLoss(rank=rank, world_size=world_size)

    def forward(self, *, step, epoch, labels, sample_index, **features):
        _Recording.calls.append({"step": step, "epoch": epoch, "labels": labels.tolist(),
                                 "index": sample_index.tolist()})
        return {"recording_loss": self.clip(**features)["clip_loss"]}


def test_objectives_receive_the_stream_epoch_across_a_dropped_remainder_and_a_resume(openmoji, tmp_path, monkeypatch):
    """The step context: ``epoch`` is the 1-based stream epoch of the batch (not a sample count, which
    lags when epoch mode drops each epoch's remainder), also after a mid-epoch resume; what an
    objective declares (labels, sample indices) reaches it."""
    from mmpretrain.losses import LOSSES
    from mmpretrain.train import fit

    monkeypatch.setitem(LOSSES, "recording", _Recording)
    n = sum(json.loads((openmoji / "train/sizes.json").read_text()).values())
    per_epoch = n // 16  # 1 rank x 1 reader x batch 16: the rest of each epoch is dropped
    assert n % 16, "the data must leave a remainder for this test"
    steps, save = per_epoch + 3, per_epoch - 2  # into the second epoch; a checkpoint mid-epoch 1

    def run(run_dir):
        return setup_run(openmoji / "train", run_dir, *COMMON, "data.num_workers=0", f"train.steps={steps}",
                         f"train.save_every={save}", "train.keep_last=5", "loss=[{name: recording}]")

    _Recording.calls = []
    fit(run(tmp_path / "a"))
    calls = _Recording.calls
    assert [c["step"] for c in calls] == list(range(steps))
    assert [c["epoch"] for c in calls] == [1] * per_epoch + [2] * 3
    first = [i for c in calls[:per_epoch] for i in c["index"]]
    assert len(set(first)) == per_epoch * 16 and max(first) < n  # each sample of epoch 1 once, n % 16 dropped
    assert all(lab >= -1 for c in calls for lab in c["labels"]) and any(lab >= 0 for c in calls for lab in c["labels"])
    records = [json.loads(x) for x in (tmp_path / "a/log.jsonl").read_text().splitlines()]
    assert records[-1]["epoch"] == pytest.approx(steps / per_epoch)  # steps / steps per epoch of the stream
    state = json.loads((tmp_path / f"a/checkpoints/step_{save:08d}/train_state.json").read_text())
    assert state["epoch"] == pytest.approx(save / per_epoch)

    b = tmp_path / "b"  # the same run stopped after its mid-epoch checkpoint
    shutil.copytree(tmp_path / "a", b)
    for p in (b / "checkpoints").iterdir():
        if p.name != f"step_{save:08d}":
            shutil.rmtree(p)
    _Recording.calls = []
    fit(run(b))
    assert [(c["step"], c["epoch"]) for c in _Recording.calls] == [(c["step"], c["epoch"]) for c in calls[save:]]
    assert [c["index"] for c in _Recording.calls] == [c["index"] for c in calls[save:]]


def test_evaluation_during_training_keeps_a_locked_tower_locked(openmoji, tmp_path):
    """LiT: a locked text tower runs without dropout. Evaluating during training must leave it so: the
    tower is still in eval mode after each evaluation, and the losses equal a run without evaluations."""
    from mmpretrain.train import fit

    def run(name, *extra):
        r = setup_run(openmoji / "train", tmp_path / name, *COMMON, "data.num_workers=0", "train.steps=3",
                      "train.save_every=null", "model.text_from_targets=false", *extra)
        fit(r)
        return r, [x["loss"] for x in map(json.loads, (tmp_path / name / "log.jsonl").read_text().splitlines())
                   if "loss" in x]

    evaluated, with_eval = run("eval", f"eval={{every: 1, datasets: [{openmoji}], tasks: [zeroshot_classification], "
                                       "num_workers: 0}")
    _, without = run("plain")
    assert with_eval == without
    clip = evaluated.accelerator.unwrap_model(evaluated.model).clip
    assert not clip.text.training and clip.visual.training


def test_two_runs_of_the_demo_config_train_the_same_weights_bit_for_bit(openmoji, demo_run, tmp_path):
    """The README's determinism sentence: the demo config, run again with the same data and overrides as
    the shared demo run (4 steps), gives the same weights and loss log to the last bit on this machine."""
    from conftest import DEMO_RUN

    again = tmp_path / "again"
    r = train(openmoji / "train", again, "train.steps=4", *DEMO_RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = "checkpoints/step_00000004/model.safetensors"
    a, b = load_file(demo_run / ckpt), load_file(again / ckpt)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(demo_run) == _losses(again)
