"""WiSE-FT through `mmpretrain.export RUN --interpolate PRETRAINED --alpha A`: the endpoints are the two
models exactly, a point between them the per-tensor interpolation, and it loads back with open_clip;
a bad alpha, a model trained from scratch and another architecture are each one line, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmpretrain.run_files import RunFolder, checkpoint_clip_weights

from conftest import run_main


def _export(run, out, *args):
    return run_main("mmpretrain.export", str(run), "--out", str(out), *args)


def test_the_endpoints_are_the_two_models_and_between_them_the_interpolation(demo_run, tmp_path):
    """The demo run's step-2 checkpoint plays the pretrained model, its latest (step 4) the fine-tune."""
    import open_clip

    pre_dir = demo_run / "checkpoints/step_00000002"
    pre = checkpoint_clip_weights(pre_dir)
    ft = checkpoint_clip_weights(RunFolder(demo_run).latest_checkpoint())
    got = {}
    for alpha in ("0", "0.25", "1"):
        r = _export(demo_run, tmp_path / alpha, "--interpolate", str(pre_dir), "--alpha", alpha)
        assert r.returncode == 0, r.stderr[-2000:]
        got[alpha] = load_file(tmp_path / alpha / "open_clip_model.safetensors")
        assert json.loads((tmp_path / alpha / "wise_ft.json").read_text()) == {
            "method": "WiSE-FT", "pretrained": str(pre_dir), "alpha": float(alpha)}
    assert got["0"].keys() == ft.keys()
    for k in ft:
        assert torch.equal(got["0"][k], pre[k].reshape(got["0"][k].shape)), k
        assert torch.equal(got["1"][k], ft[k].reshape(got["1"][k].shape)), k
        want = (0.75 * pre[k].double() + 0.25 * ft[k].double()).to(ft[k].dtype).reshape(got["0.25"][k].shape)
        assert torch.equal(got["0.25"][k], want), k
    assert not torch.equal(got["0"]["visual.conv1.weight"], got["1"]["visual.conv1.weight"])
    assert "Weight interpolation (WiSE-FT)" in (tmp_path / "0.25/README.md").read_text()
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / '0.25'}")
    assert torch.equal(model.state_dict()["visual.conv1.weight"], got["0.25"]["visual.conv1.weight"])


def test_bad_interpolations_are_one_line_and_write_nothing(demo_run, tmp_path):
    import open_clip

    pre_dir = str(demo_run / "checkpoints/step_00000002")
    cases = [
        (["--interpolate", pre_dir, "--alpha", "1.5"], "needs --alpha in [0, 1]"),
        (["--interpolate", pre_dir], "needs --alpha in [0, 1]"),
        (["--alpha", "0.5"], "--alpha needs --interpolate"),
        (["--interpolate", "--alpha", "0.5"], "trained from scratch or is not a run folder (its config.yaml has no model.pretrained)"),
        (["--interpolate", str(tmp_path / "nowhere"), "--alpha", "0.5"], "neither a file, a folder"),
    ]
    other = tmp_path / "other.safetensors"  # open_clip's tiny ViT with its own text transformer
    from mmpretrain.models import factory

    factory.register_packaged_configs()
    save_file(open_clip.create_model("mmpt-tiny-vit").state_dict(), str(other))
    cases.append((["--interpolate", str(other), "--alpha", "0.5"], "is not the run's architecture"))
    for args, message in cases:
        out = tmp_path / "out"
        r = _export(demo_run, out, *args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
        assert not out.exists(), args


def test_interpolate_refuses_an_alpha_outside_the_interval():
    from mmpretrain.export.wise_ft import WiseFTError, interpolate

    a = {"w": torch.ones(2)}
    with pytest.raises(WiseFTError, match=r"--alpha -0.1 is outside \[0, 1\]"):
        interpolate(a, a, -0.1)


def test_the_eval_sweep_gives_the_endpoints_exactly_and_plots_the_curve(demo_run, openmoji, tmp_path):
    """`mmpretrain.eval --interpolate STEP2 --alpha 0 0.5 1` on two datasets (the second a copy under
    another name, as a shifted domain): alpha 0 scores what the step-2 model scores, alpha 1 what the
    run scores, one entry per dataset and alpha, and the in- against out-of-distribution plot."""
    import shutil

    shifted = tmp_path / "shifted"
    shutil.copytree(openmoji, shifted, ignore=shutil.ignore_patterns("train"))
    pre_dir = demo_run / "checkpoints/step_00000002"
    common = ["--dataset", str(openmoji), str(shifted), "--task", "zeroshot_classification", "--num_workers", "0"]
    out = tmp_path / "curve/results.json"
    r = run_main("mmpretrain.eval", "--model", str(demo_run), *common, "--interpolate", str(pre_dir),
                 "--alpha", "0", "0.5", "1", "--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 6 and {e["wise_ft"]["alpha"] for e in rows} == {0.0, 0.5, 1.0}
    assert (tmp_path / "curve/results_wise_ft.png").stat().st_size > 0
    assert "@alpha=0.5" in r.stdout  # the printed table names each row's model

    def scores(model, path):
        r = run_main("mmpretrain.eval", "--model", str(model), *common, "--output", str(path))
        assert r.returncode == 0, r.stderr[-3000:]
        return {e["dataset"]: e["metrics"] for e in json.loads(path.read_text())["results"]}

    r = _export(demo_run, tmp_path / "step2", "--interpolate", str(pre_dir), "--alpha", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    at = {a: {e["dataset"]: e["metrics"] for e in rows if e["wise_ft"]["alpha"] == a} for a in (0.0, 1.0)}
    assert at[0.0] == scores(tmp_path / "step2", tmp_path / "s2.json")
    assert at[1.0] == scores(demo_run, tmp_path / "run.json")  # (the weights differ: the export test above)
