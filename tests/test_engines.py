"""FSDP and DeepSpeed ZeRO-2 on 2 CPU gloo ranks, through ``accelerate launch`` with the shipped configs.

accelerate refuses both engines without a GPU; tests/scripts/gpu_engine_on_cpu.py changes only its
backend choice (gloo) and device (CPU), so accelerate's own FSDP wrapping, ``save_state`` and
``load_state``, and DeepSpeed's engine and ZeRO optimizer (its CPU accelerator) drive the unchanged
trainer. In fp32 every engine must give DDP's losses on the same data, resume bit-identically,
evaluate with full weights and export what it trained.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import conftest
from conftest import DDP_RUN, accelerate_launch, run_main, train

ROOT = Path(__file__).resolve().parent.parent
WRAPPER = str(ROOT / "tests/scripts/gpu_engine_on_cpu.py")
DEEPSPEED = ROOT / ".cache/deepspeed"  # `make deepspeed` (make test-slow) installs it there
STEPS = 6  # the ddp_run fixture's steps (conftest.DDP_RUN): every engine runs the same 6 steps


def launch(openmoji: Path, run_dir: Path, config: str, launch_args: list[str], *overrides: str,
           env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """2 ranks: ``config`` cpu-2proc (DDP, no wrapper) or an engine config through the wrapper."""
    r = conftest.launch(run_dir, openmoji / "train", *DDP_RUN, *overrides, accelerate=config,
                        launch_args=tuple(launch_args), wrapper=None if config == "cpu-2proc" else WRAPPER, env=env)
    assert r.returncode == 0 or not check, r.stderr[-4000:]
    return r


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
            if "loss" in r}


def weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(run_dir / f"checkpoints/step_{step:08d}/model.safetensors")


FSDP = ["--mixed_precision", "no", "--fsdp_sync_module_states", "false"]


@pytest.fixture(scope="module")
def ddp(ddp_run) -> Path:
    return ddp_run


def check_engine_run(ddp: Path, run_dir: Path, resumed: Path, rel: float = 1e-5) -> None:
    """``run_dir``: 6 steps, checkpoints at 3 and 6; ``resumed``: the same run continued from step 3."""
    a, b = losses(ddp), losses(run_dir)
    assert sorted(b) == list(range(1, STEPS + 1))
    for step in b:  # the engine trains what DDP trains
        assert b[step] == pytest.approx(a[step], rel=rel), step
    wd, we = weights(ddp), weights(run_dir)
    assert we.keys() == wd.keys() and we["clip.logit_scale"].shape == ()  # open_clip's layout, 0-dim scale
    for k in wd:
        torch.testing.assert_close(we[k], wd[k], rtol=1e-4, atol=1e-5, msg=k)
    assert not torch.equal(we["clip.visual.conv1.weight"], weights(ddp, 3)["clip.visual.conv1.weight"])
    # the resume from step 3 continues bit for bit
    c = losses(resumed)
    assert [c[s] for s in range(4, STEPS + 1)] == [b[s] for s in range(4, STEPS + 1)]
    wr = weights(resumed)
    assert all(torch.equal(wr[k], we[k]) for k in we)


def run_args(openmoji: Path, run_dir: Path, *overrides: str) -> list[str]:
    """``python -m mmpretrain.train``'s arguments of :func:`launch`'s run."""
    return ["--config", str(conftest.CONFIG), f"data.train={openmoji / 'train'}", f"run_dir={run_dir}",
            "train.progress=false", "train.log_with=[]", "train.plots=false", *DDP_RUN, *overrides]


BF16_ENV = {"ACCELERATE_MIXED_PRECISION": "bf16"}  # what `accelerate launch --mixed_precision bf16` sets


@pytest.fixture(scope="module")
def fsdp_runs(openmoji, ddp, tmp_path_factory) -> dict:
    """One launch of the shipped fsdp.yaml (FSDP1, FULL_SHARD, use_orig_params, full state dict) on 2
    ranks running five trainer runs in order (tests/scripts/ddp_checks.py's ``runs``; each launch of its
    own cost ~12 s of start-up): ``fsdp``, 6 steps evaluated at the last; ``fsdp_resumed`` from its step 3;
    ``bf16`` (FSDP's MixedPrecision: mixed_precision bf16, train.precision=bf16) and ``bf16_resumed``
    from its step 3; ``cross``, DDP's step-3 checkpoint resumed under FSDP. Returns the report's runs,
    each with its ``dir``."""
    out = tmp_path_factory.mktemp("engines")
    evals = f"eval={{every: {STEPS}, datasets: [{openmoji}], tasks: [zeroshot_classification], num_workers: 0}}"
    plan = [("fsdp", {}, [evals]), ("fsdp_resumed", {}, [f"resume={out / 'fsdp/checkpoints/step_00000003'}"]),
            ("bf16", BF16_ENV, ["train.precision=bf16"]),
            ("bf16_resumed", BF16_ENV, ["train.precision=bf16", f"resume={out / 'bf16/checkpoints/step_00000003'}"]),
            ("cross", {}, [f"resume={ddp / 'checkpoints/step_00000003'}"])]
    runs = [{"name": name, "env": env, "args": run_args(openmoji, out / name, *extra)} for name, env, extra in plan]
    (out / "plan.json").write_text(json.dumps({"runs": runs, "report": str(out / "report.json")}))
    cmd = [*accelerate_launch("fsdp"), "--num_processes", "2", *FSDP, WRAPPER,
           str(ROOT / "tests/scripts/ddp_checks.py"), str(out / "plan.json")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())["runs"]
    for name, got in report.items():
        assert got["exit"] == 0 or name == "cross", (name, got["stderr"])  # cross: refused (its test)
        got["dir"] = out / name
    return report


@pytest.fixture(scope="module")
def fsdp(fsdp_runs) -> Path:
    """The shipped fsdp.yaml's 6 steps, evaluated at the last (every test here reads, none writes)."""
    return fsdp_runs["fsdp"]["dir"]


def test_fsdp_trains_as_ddp_resumes_exactly_and_exports(ddp, fsdp, fsdp_runs, tmp_path):
    """The shipped fsdp.yaml (FSDP1, use_orig_params, full state dict): logit scale and bias built as
    1-element vectors (FSDP1 refuses 0-dim parameters), the gathered model.safetensors beside
    accelerate's pytorch_model_fsdp.bin."""
    run_dir, resumed = fsdp, fsdp_runs["fsdp_resumed"]["dir"]
    ckpt = run_dir / f"checkpoints/step_{STEPS:08d}"
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "model.safetensors"} <= {p.name for p in ckpt.iterdir()}
    check_engine_run(ddp, run_dir, resumed)

    # the export holds the trained weights, with open_clip's 0-dim logit scale
    r = run_main("mmpretrain.export", str(run_dir), "--out", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr[-3000:]
    exported = load_file(tmp_path / "export/open_clip_model.safetensors")
    trained = weights(run_dir)
    assert exported["logit_scale"].shape == ()
    clip = {k.removeprefix("clip."): v for k, v in trained.items() if k.startswith("clip.")}
    assert exported.keys() == clip.keys() and all(torch.equal(exported[k], v) for k, v in clip.items())


@pytest.fixture(scope="module")
def bf16(fsdp_runs) -> Path:
    """What configs/accelerate/fsdp.yaml runs on GPUs, 6 steps: FSDP1, FULL_SHARD over 2 ranks, bf16 through
    FSDP's MixedPrecision (mixed_precision: bf16, train.precision=bf16)."""
    return fsdp_runs["bf16"]["dir"]


def test_fsdp1_bf16_full_shard_trains_and_exports(ddp, bf16, tmp_path):
    """It trains as fp32 DDP does to bf16's precision, its checkpoint holds fp32 master weights, and the
    export holds what it trained."""
    b, a = losses(bf16), losses(ddp)
    assert sorted(b) == list(range(1, STEPS + 1))
    assert all(b[s] == pytest.approx(a[s], rel=0.03) for s in b)  # bf16 against DDP's fp32
    assert any(b[s] != a[s] for s in b)  # and bf16 it was
    w = weights(bf16)
    assert all(v.dtype == torch.float32 for v in w.values() if v.is_floating_point())
    assert not torch.equal(w["clip.visual.conv1.weight"], weights(bf16, 3)["clip.visual.conv1.weight"])
    r = run_main("mmpretrain.export", str(bf16), "--out", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr[-3000:]
    exported = load_file(tmp_path / "export/open_clip_model.safetensors")
    assert all(torch.equal(exported[k.removeprefix("clip.")], v) for k, v in w.items() if k.startswith("clip."))


def test_fsdp1_bf16_resumes_exactly(bf16, fsdp_runs):
    """A resume from step 3 under bf16 continues bit for bit, losses and weights."""
    resumed = fsdp_runs["bf16_resumed"]["dir"]
    b, c = losses(bf16), losses(resumed)
    assert [c[s] for s in range(4, STEPS + 1)] == [b[s] for s in range(4, STEPS + 1)]
    w, wr = weights(bf16), weights(resumed)
    assert all(torch.equal(wr[k], w[k]) for k in w)


def test_fsdp_evaluates_full_weights_and_refuses_another_engines_checkpoint(openmoji, fsdp, fsdp_runs, tmp_path):
    """Evaluation inside summon_full_params during training = the CLI's on the checkpoint; a DDP
    checkpoint resumed under FSDP is refused before any work (accelerate would fail inside load_state)."""
    cross = fsdp_runs["cross"]
    assert cross["exit"] != 0 and "was written under DDP, this launch uses FSDP" in cross["stderr"], cross["stderr"]
    assert "model.pretrained=" in cross["stderr"] and not cross["dir"].exists()

    during = json.loads((fsdp / "results.json").read_text())["results"][0]
    out = tmp_path / "after.json"
    r = run_main("mmpretrain.eval", "--model", str(fsdp), "--dataset", str(openmoji), "--task",
                "zeroshot_classification", "--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    after = json.loads(out.read_text())["results"][0]
    assert during["n"] == after["n"] > 0
    assert during["metrics"] == pytest.approx(after["metrics"], abs=1 / after["n"])  # at most one image flips


@pytest.mark.slow
def test_fsdp2_sharded_state_with_grad_cache(openmoji, ddp, tmp_path):
    """FSDP2 (fully_shard) with sharded checkpoints (pytorch_model_fsdp_0/, optimizer_0/) and gradient
    caching (micro-batches of 4): DDP's losses, a bit-identical resume from the sharded save; bf16
    trains and evaluates; DDP's own 2-rank resume is bit-identical too."""
    args = [*FSDP, "--fsdp_version", "2", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"]
    run_dir, resumed = tmp_path / "fsdp2", tmp_path / "resumed"
    launch(openmoji, run_dir, "fsdp", args, "train.micro_batch_size=4")
    names = {p.name for p in (run_dir / "checkpoints/step_00000003").iterdir()}
    assert {"pytorch_model_fsdp_0", "optimizer_0", "model.safetensors"} <= names
    launch(openmoji, resumed, "fsdp", args, "train.micro_batch_size=4",
           f"resume={run_dir / 'checkpoints/step_00000003'}")
    check_engine_run(ddp, run_dir, resumed)

    # bf16: FSDP's mixed-precision policy gathers bf16 parameters; evaluation runs under autocast
    bf16 = tmp_path / "bf16"
    evals = f"eval={{every: 3, datasets: [{openmoji}], tasks: [zeroshot_classification], num_workers: 0}}"
    launch(openmoji, bf16, "fsdp", [a for a in args if a not in ("--mixed_precision", "no")], "train.precision=bf16",
           "train.steps=3", evals)
    b, a = losses(bf16), losses(ddp)
    assert all(b[s] == pytest.approx(a[s], rel=0.03) for s in (1, 2, 3))
    assert json.loads((bf16 / "results.json").read_text())["results"][0]["n"] > 0

    # and DDP itself: a resume from step 3 continues bit for bit under 2 ranks
    again = tmp_path / "ddp_resumed"
    launch(openmoji, again, "cpu-2proc", [], f"resume={ddp / 'checkpoints/step_00000003'}")
    assert [losses(again)[s] for s in (4, 5, 6)] == [losses(ddp)[s] for s in (4, 5, 6)]
    assert all(torch.equal(v, weights(ddp)[k]) for k, v in weights(again).items())


def deepspeed_env() -> dict[str, str]:
    if not (DEEPSPEED / "deepspeed").is_dir():
        pytest.skip(f"deepspeed is not installed in {DEEPSPEED}: `make deepspeed` (make test-slow runs it)")
    return {"PYTHONPATH": str(DEEPSPEED), "DS_ACCELERATOR": "cpu"}


@pytest.mark.slow
def test_deepspeed_zero2_trains_as_ddp_resumes_exactly_and_refuses_micro_batches(openmoji, ddp, tmp_path):
    """The shipped deepspeed-zero2.yaml on DeepSpeed's CPU accelerator: batch sizes set from
    data.batch_size (no prepared DataLoader), fp32 master weights written as model.safetensors,
    DDP's losses in fp32; bf16 trains (images cast to the engine's bf16 weights, the objective in
    fp32); micro-batches are refused before any work (the engine steps in every backward)."""
    env = deepspeed_env()
    run_dir, resumed = tmp_path / "ds", tmp_path / "resumed"
    launch(openmoji, run_dir, "deepspeed-zero2", [], env=env)
    assert (run_dir / "checkpoints/step_00000003/pytorch_model").is_dir()
    launch(openmoji, resumed, "deepspeed-zero2", [], f"resume={run_dir / 'checkpoints/step_00000003'}", env=env)
    check_engine_run(ddp, run_dir, resumed)

    bf16 = tmp_path / "bf16"
    evals = f"eval={{every: 3, datasets: [{openmoji}], tasks: [zeroshot_classification], num_workers: 0}}"
    launch(openmoji, bf16, "deepspeed-zero2", [], "train.precision=bf16", "train.steps=3", evals, env=env)
    assert json.loads((bf16 / "results.json").read_text())["results"][0]["n"] > 0
    assert (bf16 / "checkpoints/step_00000003/pytorch_model/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    b, a = losses(bf16), losses(ddp)
    assert all(b[s] == pytest.approx(a[s], rel=0.03) for s in (1, 2, 3))
    assert weights(bf16, 3)["clip.visual.conv1.weight"].dtype == torch.float32

    r = launch(openmoji, tmp_path / "micro", "deepspeed-zero2", [], "train.micro_batch_size=4", env=env, check=False)
    assert r.returncode != 0 and "train.micro_batch_size=4 under DeepSpeed: its backward steps" in r.stderr
    assert not (tmp_path / "micro" / "checkpoints").exists()


@pytest.mark.parametrize("var,name", [("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")])
def test_an_engine_on_a_machine_without_gpus_is_refused(openmoji, tmp_path, monkeypatch, var, name):
    """Without the wrapper accelerate would run plain data parallelism under a DeepSpeed config on a
    CPU (and stop inside FSDP's plugin under an FSDP one): refused up front, naming the fix."""
    monkeypatch.setenv(var, "true")
    r = train(openmoji / "train", tmp_path / "run", *DDP_RUN)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"asks for {name}, which needs GPUs" in r.stderr and "cpu-2proc.yaml" in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_fsdp_region_weighting_as_ddp_and_resumes_exactly(openmoji, tmp_path):
    """The stateful objective (bank, k-means centroids on rank 0 broadcast, Hedge weights) under FSDP1:
    DDP's losses and region weights, and a bit-identical resume with its objective state restored."""
    regions = ("loss=[{name: regions, options: {base: clip, scales: [2, 4], bank_size: 48, refresh_every: 2, "
               "warmup_steps: 2}}]")
    ddp, fsdp, resumed = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "resumed"
    launch(openmoji, ddp, "cpu-2proc", [], regions)
    launch(openmoji, fsdp, "fsdp", FSDP, regions)
    assert (fsdp / "checkpoints/step_00000003/objective.safetensors").is_file()
    launch(openmoji, resumed, "fsdp", FSDP, regions, f"resume={fsdp / 'checkpoints/step_00000003'}")
    check_engine_run(ddp, fsdp, resumed)
    log = [json.loads(x) for x in (fsdp / "log.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (ddp / "log.jsonl").read_text().splitlines()]
    assert [r["regions/active"] for r in log] == [0, 0, 1, 1, 1, 1]
    assert log[-1]["regions/m4/q_entropy"] == pytest.approx(want[-1]["regions/m4/q_entropy"], rel=1e-5)
    a = load_file(fsdp / f"checkpoints/step_{STEPS:08d}/objective.safetensors")
    b = load_file(resumed / f"checkpoints/step_{STEPS:08d}/objective.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# open_clip's CoCa (mmpt-tiny-coca) with its caption decoder, trained by clip + 2 x caption
COCA = ["model.arch=mmpt-tiny-coca", "model.lock_text=false", "model.text_from_targets=false",
        "loss=[{name: clip}, {name: caption, weight: 2.0}]"]


@pytest.mark.slow
def test_fsdp_caption_decoder_as_ddp_and_resumes_exactly(openmoji, tmp_path):
    """The caption decoder under FSDP1 (FULL_SHARD, use_orig_params): DDP's losses, caption term included, and
    weights, decoder included, and a bit-identical resume (tests/test_caption.py launches DDP in make test)."""
    ddp, fsdp, resumed = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "resumed"
    launch(openmoji, ddp, "cpu-2proc", [], *COCA)
    launch(openmoji, fsdp, "fsdp", FSDP, *COCA)
    launch(openmoji, resumed, "fsdp", FSDP, *COCA, f"resume={fsdp / 'checkpoints/step_00000003'}")
    check_engine_run(ddp, fsdp, resumed)
    a = [json.loads(x) for x in (fsdp / "log.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (ddp / "log.jsonl").read_text().splitlines()]
    assert [r["caption_unweighted"] for r in a] == pytest.approx([r["caption_unweighted"] for r in b], rel=1e-5)
    wd = weights(ddp)  # check_engine_run compared the FSDP weights with these, decoder included
    decoder = [k for k in wd if k.startswith("clip.text_decoder.")]
    assert decoder and not torch.equal(wd[decoder[0]], weights(ddp, 3)[decoder[0]])  # the decoder trained


@pytest.mark.slow
def test_deepspeed_caption_decoder_as_ddp_and_resumes_exactly(openmoji, tmp_path):
    """The caption decoder under the shipped deepspeed-zero2.yaml (its CPU accelerator): DDP's losses and
    weights, decoder included, and a bit-identical resume."""
    env = deepspeed_env()
    ddp, ds, resumed = tmp_path / "ddp", tmp_path / "ds", tmp_path / "resumed"
    launch(openmoji, ddp, "cpu-2proc", [], *COCA)
    launch(openmoji, ds, "deepspeed-zero2", [], *COCA, env=env)
    launch(openmoji, resumed, "deepspeed-zero2", [], *COCA, f"resume={ds / 'checkpoints/step_00000003'}", env=env)
    check_engine_run(ddp, ds, resumed)
    a = [json.loads(x) for x in (ds / "log.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (ddp / "log.jsonl").read_text().splitlines()]
    assert [r["caption_unweighted"] for r in a] == pytest.approx([r["caption_unweighted"] for r in b], rel=1e-5)
