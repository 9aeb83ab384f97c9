"""docs/evidence.md is what scripts/reports/evidence.py generates from the committed experiment JSON (no
number typed by hand), and its claim verdicts follow the tables' significance rule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, script

evidence = script("scripts/reports/evidence.py")


@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_evidence_page_matches_the_experiment_json():
    text = subprocess.run([sys.executable, str(ROOT / "scripts/reports/evidence.py")], capture_output=True, text=True,
                          check=True).stdout.strip()
    doc = (ROOT / "docs/evidence.md").read_text()
    block = doc.split(evidence.START, 1)[1].split(evidence.END, 1)[0].strip()
    assert block == text, "docs/evidence.md is stale: run python scripts/reports/evidence.py --write"
    for name in evidence.load():  # every committed grid is on the page, with its plots
        assert f"bench_results/experiments/{name}.json" in block
        for plot in ("acc1", "claims"):
            assert (ROOT / f"bench_results/experiments/{name}_{plot}.png").is_file()


def test_verdicts_follow_the_significance_rule():
    up = evidence.compare([0.9, 0.92, 0.91], [0.80, 0.82, 0.81], +1)
    assert up["verdict"] == "reproduces" and abs(up["delta"] - 0.1) < 1e-12
    assert evidence.compare([0.9, 0.92, 0.91], [0.80, 0.82, 0.81], -1)["verdict"] == "reversed"
    # |Δ| = 0.01 against a bound of 2·sqrt(0.05²/3 + 0.05²/3) ≈ 0.082
    assert evidence.compare([0.85, 0.90, 0.95], [0.84, 0.89, 0.94], +1)["verdict"] == "not significant"
    assert evidence.compare([0.9], [0.8], +1)["verdict"] == "too few seeds"


def _cell(variant, seed, acc, neg_var=0.02, regions=None):
    return {"variant": variant, "seed": seed, "batch_size": 64, "steps": 10, "train_seconds": 60.0,
            "metrics": {"heldout/acc1": acc, "heldout/ari": acc / 2, "heldout/ari_preproj": acc / 3},
            "geometry": {"neg_sim_var": neg_var, "excessive_separation": 0.0}, "regions": regions or [],
            "curve": [[10, acc]]}


def test_section_tables_and_claims_from_a_grid():
    regions = [[20, {"m10/purity": 0.5, "m10/q_entropy": 2.30, "m10/q_max": 0.11}],
               [50, {"m10/purity": 0.7, "m10/q_entropy": 2.20, "m10/q_max": 0.15}]]
    cells = {}
    for s in range(3):
        cells[f"clip|seed{s}|b64"] = _cell("clip", s, 0.80 + 0.01 * s)
        cells[f"clip_vrn|seed{s}|b64"] = _cell("clip_vrn", s, 0.81 + 0.01 * s, neg_var=0.01 + 0.001 * s)
        cells[f"regions_image|seed{s}|b64"] = _cell("regions_image", s, 0.80 + 0.01 * s, regions=regions)
    text = "\n".join(evidence.section("mnist", {"cells": cells, "settings": {"steps": 10, "eval_every": 5},
                                                "wall_seconds": 600}))
    assert "9 cells (3 variants x seeds [0, 1, 2] x batch [64]), 10 steps each" in text
    assert "| clip_vrn | 3 | 0.820 ± 0.010 (+0.010) |" in text  # Δ inside the bound: no star
    vrn = next(line for line in text.splitlines() if line.startswith("| VRN lowers"))
    assert "clip_vrn: 0.011 ± 1.00e-03" in vrn and vrn.endswith("| reproduces |")
    pre = next(line for line in text.splitlines() if line.startswith("| pre-projection"))
    assert pre.endswith("| reversed |")  # ari_preproj = acc/3 < ari = acc/2 in every seed
    assert "q entropy 2.2000 (uniform 2.3026)" in text and "batch purity (m = 10) 0.500 at step 20, 0.700 at step 50" in text


def test_batch_gap_and_a_supplementary_grid_show_steps_epochs_and_verdicts():
    def cells(batches, epochs):
        out = {}
        for b, e in zip(batches, epochs):
            for s in range(3):
                for v, acc in (("clip", 0.90), ("global_clip", 0.85 if b == 32 else 0.95)):
                    c = _cell(v, s, acc + 0.001 * s)
                    out[f"{v}|seed{s}|b{b}"] = {**c, "batch_size": b, "epochs": e}
        return out

    main = "\n".join(evidence.batch_gap_rows(cells([32, 128], [4.4, 17.7]), 550))
    assert "| 32 | 550 | 4.4 | 0.901 ± 1.00e-03 | 0.851 ± 1.00e-03 | -0.05 (bound 0.0016) | reversed |" in main
    assert "| 128 | 550 | 17.7 |" in main and "+0.05 (bound 0.0016) | reproduces |" in main
    # the change of the gap against the bound of a difference of two Δs: sqrt(0.0016² + 0.0016²)
    assert "Gap at batch 32 minus gap at batch 128: -0.1 (bound 0.0023; shrinks as the batch shrinks)." in main
    long = {"cells": cells([32], [17.7]), "settings": {"steps": 2200, "eval_every": 440}}
    text = "\n".join(evidence.supplement_rows("long_schedule", "mnist", long))
    assert "`bench_results/experiments/long_schedule/mnist.json`, 6 cells" in text
    assert "| 32 | 2200 | 17.7 |" in text and text.splitlines()[0].startswith("`global_clip` against `clip` over")
    # against the main grid's batch with the closest epochs (128 here: 17.7, against 4.4 at batch 32)
    text = "\n".join(evidence.supplement_rows("long_schedule", "mnist", long, cells([32, 128], [4.4, 17.7])))
    assert ("At about the same epochs (17.7 here, 17.7 for the main grid's batch 128), the gap at batch 32 minus "
            "the gap at batch 128: -0.1 (bound 0.0023; shrinks as the batch shrinks).") in text
    # one batch size is enough for a supplement; nothing to compare renders nothing
    assert evidence.supplement_rows("long_schedule", "mnist", {"cells": {}, "settings": long["settings"]}) == []
    small, large = {"delta": -0.01, "bound": 0.02}, {"delta": -0.02, "bound": 0.02}
    assert evidence._gap_change(small, large) == "+0.01 (bound 0.028; inside the bound: no measured change with batch size)"
    assert "grows as the batch shrinks" in evidence._gap_change({"delta": 0.05, "bound": 0.01}, large)
