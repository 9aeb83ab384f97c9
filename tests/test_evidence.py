"""The README's "Evidence" section is what scripts/evidence.py generates from the committed experiment
JSON (no number typed by hand), and its claim verdicts follow the tables' significance rule."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import evidence  # noqa: E402


def test_readme_evidence_matches_the_experiment_json():
    text = subprocess.run([sys.executable, str(ROOT / "scripts/evidence.py")], capture_output=True, text=True,
                          check=True).stdout.strip()
    readme = (ROOT / "README.md").read_text()
    block = readme.split(evidence.START, 1)[1].split(evidence.END, 1)[0].strip()
    assert block == text, "README evidence section is stale: run python scripts/evidence.py --write"
    for name in evidence.load():  # every committed grid is in the README, with its plots
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
