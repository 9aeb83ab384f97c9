"""docs/evidence.md, generated from the experiment grid's JSON (no number typed by hand).

    python scripts/reports/evidence.py            print the section's generated block
    python scripts/reports/evidence.py --write    replace the block between docs/evidence.md's markers and
                                          draw bench_results/experiments/<data>_claims.png

Reads bench_results/experiments/<data>.json as scripts/reports/experiment.py writes it: per dataset the table
(variant x metric, mean ± sd over seeds, Δ vs ``clip``, ``*`` when |Δ| > 2·sqrt(sd_v²/n + sd_clip²/n)),
then each claim's measured check with the same rule, and the diagnostics that say why a claim does or
does not reproduce. A test keeps the doc's block equal to what this prints.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from experiment import TABLE, VARIANTS  # siblings (the script's folder is on sys.path): one list of variants
from perf_table import write_block

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench_results" / "experiments"
DOC = ROOT / "docs" / "evidence.md"
START, END = "<!-- evidence:start -->", "<!-- evidence:end -->"

DATASETS = {
    "mnist": "MNIST (`demo:mnist`: 4,000 training digits, 1,000 held-out, stratified; scikit-learn's 1,797 "
             "8x8 digits as the out-of-domain zero-shot set)",
    "openmoji": "OpenMoji (`demo:openmoji`: the demo's emoji and Unicode-name captions, held-out split)",
    "openmoji-all": "Every OpenMoji emoji (`demo:openmoji-all`: 2,873 training / 1,177 held-out images split by "
                    "base emoji, zero-shot over 64 Unicode subgroups, several captions per image; the held-out "
                    "emoji drawn by Noto as the cross-style set)",
}
LABELS = {"heldout/acc1": "zero-shot acc1", "heldout/lp_acc1": "linear probe", "heldout/knn_acc1": "k-NN",
          "heldout/ari": "ARI", "heldout/ari_preproj": "ARI pre-proj.", "digits/acc1": "digits acc1 (OOD)",
          "retrieval/image_retrieval_recall@5": "image R@5", "cross_style/acc1": "Noto acc1 (cross-style)",
          "cross_style_retrieval/image_retrieval_recall@5": "Noto image R@5", "captioning/Bleu_4": "BLEU-4",
          "captioning/CIDEr": "CIDEr", "dense/dense_miou": "dense mIoU", "dense/dense_patch_acc": "dense patch acc"}


def cell_value(cell: dict, source: str, key: str) -> float | None:
    """A cell's number for a claim: a final metric, the last geometry diagnostic, or a region diagnostic
    (``purity_first`` / ``purity_last``: scale m10's batch purity at its first and last logged step)."""
    if source == "metrics":
        return cell["metrics"].get(key)
    if source == "geometry":
        return cell.get("geometry", {}).get(key)
    curve = [d for _, d in cell.get("regions") or [] if f"m10/{key.split('_')[0]}" in d]
    if not curve:
        return None
    name = "m10/" + key.rsplit("_", 1)[0]
    return curve[0][name] if key.endswith("_first") else curve[-1][name]


def compare(values: list[float], ref: list[float], direction: int) -> dict:
    """Mean, sd and Δ of ``values`` against ``ref`` (independent seeds), and the verdict on a claim that
    ``values`` is higher (``direction`` +1) or lower (-1): the significance rule of the tables."""
    mean, mref = statistics.fmean(values), statistics.fmean(ref)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    sdr = statistics.stdev(ref) if len(ref) > 1 else 0.0
    delta = mean - mref
    bound = 2 * math.sqrt(sd ** 2 / len(values) + sdr ** 2 / len(ref))
    if len(values) < 2 or len(ref) < 2:
        verdict = "too few seeds"
    elif abs(delta) <= bound:
        verdict = "not significant"
    elif delta * direction > 0:
        verdict = "reproduces"
    else:
        verdict = "reversed"
    return {"mean": mean, "sd": sd, "ref_mean": mref, "ref_sd": sdr, "delta": delta, "bound": bound,
            "verdict": verdict}


def fmt(x: float) -> str:
    return f"{x:.3f}" if abs(x) >= 0.01 or x == 0 else f"{x:.2e}"


def by_variant(cells: dict, batch: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for c in cells.values():
        if c["batch_size"] == batch:
            out.setdefault(c["variant"], []).append(c)
    return out


def _claims(group: str) -> list[tuple]:
    """The claims of claims.json's ``group``, as tuples in its field order (a pair of keys as a tuple)."""
    rows = json.loads((Path(__file__).with_name("claims.json")).read_text())[group]
    return [tuple(tuple(v) if isinstance(v, list) else v for v in row.values()) for row in rows]


# (claim, variant, baseline, source, key, direction): baseline None compares two keys of the same cells
CLAIMS = _claims("grid")


def _gaps(cells: dict, variant: str, metric: str) -> list[tuple[int, dict, float | None]]:
    """``(batch, comparison, mean epochs)`` for every batch size holding both ``variant`` and CLIP."""
    rows = []
    for batch in sorted({c["batch_size"] for c in cells.values()}):
        groups = by_variant(cells, batch)
        if variant in groups and "clip" in groups:
            r = compare([c["metrics"][metric] for c in groups[variant]], [c["metrics"][metric] for c in groups["clip"]], +1)
            epochs = [c["epochs"] for c in groups[variant] + groups["clip"] if c.get("epochs") is not None]
            rows.append((batch, r, statistics.fmean(epochs) if epochs else None))
    return rows


def _gap_table(rows: list, variant: str, steps: int) -> list[str]:
    out = ["| batch | steps | epochs | clip | " + variant + " | Δ | verdict |", "|---|---|---|---|---|---|---|"]
    out += [f"| {b} | {steps} | {'–' if e is None else f'{e:.1f}'} | {fmt(r['ref_mean'])} ± {fmt(r['ref_sd'])} | "
            f"{fmt(r['mean'])} ± {fmt(r['sd'])} | {r['delta']:+.3g} (bound {r['bound']:.2g}) | {r['verdict']} |"
            for b, r, e in rows]
    return out


def batch_gap_rows(cells: dict, steps: int, variant: str = "global_clip", metric: str = "heldout/acc1") -> list[str]:
    """``variant`` against CLIP at every batch size holding both: the claim is that the gap grows as the
    batch shrinks."""
    rows = _gaps(cells, variant, metric)
    if len(rows) < 2:
        return []
    out = [f"`{variant}` against `clip` by batch size (`{metric}`, same steps):", ""] + _gap_table(rows, variant, steps)
    out += ["", f"Gap at batch {rows[0][0]} minus gap at batch {rows[-1][0]}: "
            + _gap_change(rows[0][1], rows[-1][1]) + ".", ""]
    return out


def _gap_change(small: dict, large: dict) -> str:
    """The gap at the smaller batch minus the gap at the larger, with the bound of a difference of two
    independent Δs (sqrt(bound_1² + bound_2²), the same 2-standard-error rule)."""
    diff, bound = small["delta"] - large["delta"], math.hypot(small["bound"], large["bound"])
    verdict = "grows as the batch shrinks" if diff > bound else (
        "shrinks as the batch shrinks" if diff < -bound else "inside the bound: no measured change with batch size")
    return f"{diff:+.3g} (bound {bound:.2g}; {verdict})"


# further grids of a dataset, each in bench_results/experiments/<folder>/<data>.json (experiment.py --out),
# each asking one question of the main grid's result
SUPPLEMENTS = {
    "long_schedule": ("`global_clip` against `clip` over a longer schedule at batch 32, about as many epochs as "
                      "batch 128 gets in the main grid: whether the per-sample estimates need more passes over the data "
                      "than the short schedule gives them", "global_clip", "heldout/acc1"),
}


def supplement_rows(folder: str, name: str, data: dict, main: dict | None = None) -> list[str]:
    """The supplementary grid's comparison; with the main grid's cells, also its gap against the main
    grid's batch size whose cells ran the closest number of epochs."""
    question, variant, metric = SUPPLEMENTS[folder]
    rows = _gaps(data["cells"], variant, metric)
    if not rows:
        return []
    s = data["settings"]
    out = ([f"{question[0].upper()}{question[1:]} (`bench_results/experiments/{folder}/{name}.json`, "
            f"{len(data['cells'])} cells, `{metric}`, held-out evaluation every {s['eval_every']} steps):", ""]
           + _gap_table(rows, variant, s["steps"]) + [""])
    others = [r for r in _gaps(main or {}, variant, metric) if r[2] is not None]
    for batch, r, epochs in rows:
        near = [o for o in others if o[0] != batch]
        if epochs is None or not near:
            continue
        b2, r2, e2 = min(near, key=lambda o: abs(o[2] - epochs))
        small, large = (r, r2) if batch < b2 else (r2, r)
        out += [f"At about the same epochs ({epochs:.1f} here, {e2:.1f} for the main grid's batch {b2}), the gap at "
                f"batch {min(batch, b2)} minus the gap at batch {max(batch, b2)}: {_gap_change(small, large)}.", ""]
    return out


def claim_rows(cells: dict, batch: int) -> list[str]:
    groups = by_variant(cells, batch)
    out = ["| claim | measure | variant | baseline | Δ | verdict |", "|---|---|---|---|---|---|"]
    for claim, variant, base, source, key, direction in CLAIMS:
        if variant not in groups or (base and base not in groups):
            continue
        if base is None:  # two measures of the same cells
            vals = [c["metrics"][key[0]] for c in groups[variant] if key[0] in c["metrics"]]
            ref = [c["metrics"][key[1]] for c in groups[variant] if key[1] in c["metrics"]]
            measure, vname, bname = f"`{key[0]}` vs `{key[1]}`", f"{variant}, pre-proj.", f"{variant}, projected"
        else:
            vals = [v for c in groups[variant] if (v := cell_value(c, source, key)) is not None]
            ref = [v for c in groups[base] if (v := cell_value(c, source, key)) is not None]
            measure, vname, bname = f"`{source}/{key}`", variant, base
        if not vals or not ref:
            continue
        r = compare(vals, ref, direction)
        out.append(f"| {claim} | {measure} | {vname}: {fmt(r['mean'])} ± {fmt(r['sd'])} | {bname}: "
                   f"{fmt(r['ref_mean'])} ± {fmt(r['ref_sd'])} | {r['delta']:+.3g} (bound {r['bound']:.2g}) | "
                   f"{r['verdict']} |")
    return out


def region_diagnostics(cells: dict, batch: int, steps: int) -> list[str]:
    """How far Hedge moved each scale's weights (entropy against uniform log m, largest weight against
    1/m) and the batch purity at the first and last logged step, mean over seeds."""
    groups = by_variant(cells, batch)
    out = []
    for variant in ("regions_image", "regions_target"):
        cs = [c for c in groups.get(variant, []) if c.get("regions")]
        if not cs:
            continue
        parts = []
        for m in (5, 10, 20):
            last = [c["regions"][-1][1] for c in cs if f"m{m}/q_entropy" in c["regions"][-1][1]]
            if not last:
                continue
            ent = statistics.fmean(d[f"m{m}/q_entropy"] for d in last)
            qmax = statistics.fmean(d[f"m{m}/q_max"] for d in last)
            parts.append(f"m = {m}: q entropy {ent:.4f} (uniform {math.log(m):.4f}), q max {qmax:.4f} (uniform "
                         f"{1 / m:.4f})")
        first = [cell_value(c, "regions", "purity_first") for c in cs]
        last_p = [cell_value(c, "regions", "purity_last") for c in cs]
        start = cs[0]["regions"][0][0]
        out.append(f"- `{variant}` ({len(cs)} seeds), at step {steps}: " + "; ".join(parts)
                   + f"; batch purity (m = 10) {statistics.fmean(first):.3f} at step {start}, "
                   f"{statistics.fmean(last_p):.3f} at step {cs[0]['regions'][-1][0]}.")
    return out


def section(name: str, data: dict, supplements: dict[str, dict] | None = None) -> list[str]:
    cells, settings = data["cells"], data["settings"]
    batches = sorted({c["batch_size"] for c in cells.values()})
    seeds = sorted({c["seed"] for c in cells.values()})
    wall = data.get("wall_seconds", data.get("wall_seconds_this_call"))
    train_s = sum(c["train_seconds"] for c in cells.values())
    out = [f"### {DATASETS.get(name, name)}", "",
           f"{len(cells)} cells ({len({c['variant'] for c in cells.values()})} variants x seeds {seeds} x batch "
           f"{batches}), {settings['steps']} steps each, held-out evaluation every {settings['eval_every']} steps; "
           f"model `{settings.get('model')}` with `model.overrides` {json.dumps(settings.get('model_overrides', {}))}"
           + (f", region warm-up {settings['region_warmup']} steps" if "region_warmup" in settings else "")
           + f"; training processes {train_s / 60:.0f} min in all"
           + (f", grid wall time {wall / 60:.0f} min" if wall else "") + f" (`bench_results/experiments/{name}.json`).",
           ""]
    metrics = [m for m in TABLE if any(m in c["metrics"] for c in cells.values())]
    for batch in batches:
        groups = by_variant(cells, batch)
        ref = {m: [c["metrics"][m] for c in groups.get("clip", []) if m in c["metrics"]] for m in metrics}
        out += ["| variant | seeds | " + " | ".join(LABELS.get(m, m) for m in metrics) + " |",
                "|---|---|" + "---|" * len(metrics)]
        for variant in sorted(groups, key=lambda v: list(VARIANTS).index(v) if v in VARIANTS else 99):
            texts = []
            for m in metrics:
                vals = [c["metrics"][m] for c in groups[variant] if m in c["metrics"]]
                if not vals:
                    texts.append("–")
                    continue
                sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                text = f"{statistics.fmean(vals):.3f} ± {sd:.3f}"
                if variant != "clip" and ref[m]:
                    r = compare(vals, ref[m], +1)
                    text += f" ({r['delta']:+.3f}{'*' if r['verdict'] in ('reproduces', 'reversed') else ''})"
                texts.append(text)
            out.append(f"| {variant} | {len(groups[variant])} | " + " | ".join(texts) + " |")
        out.append("")
        claims = claim_rows(cells, batch)
        if len(claims) > 2:
            out += [f"Claims at batch {batch}, each with its measured check (same significance rule):", ""]
            out += claims + [""]
        diag = region_diagnostics(cells, batch, settings["steps"])
        if diag:
            out += ["Region weighting, what Hedge did (mean over seeds):", ""] + diag + [""]
    out += batch_gap_rows(cells, settings["steps"])
    for folder, extra in (supplements or {}).items():
        out += supplement_rows(folder, name, extra, cells)
    out += [f"![held-out zero-shot acc1 over training](bench_results/experiments/{name}_acc1.png)",
            f"![each claim's measure, every seed](bench_results/experiments/{name}_claims.png)", ""]
    return out


def load() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json")) if p.stem in DATASETS}


def load_supplements() -> dict[str, dict[str, dict]]:
    """``data -> folder -> grid`` for every supplementary grid that has been run."""
    found: dict[str, dict[str, dict]] = {}
    for folder in SUPPLEMENTS:
        for name in DATASETS:
            p = RESULTS / folder / f"{name}.json"
            if p.is_file():
                found.setdefault(name, {})[folder] = json.loads(p.read_text())
    return found


# (claim, variant, baseline, metric, direction) of the curation run (scripts/reports/curation.py)
CURATION_CLAIMS = _claims("curation")


def curation_section(data: dict) -> list[str]:
    """The curation run's table, claims and the filter's precision and recall."""
    st, summ, f = data["settings"], data["summary"], data["filter"]
    metrics = [m for m in TABLE if all(m in summ[k] for k in ("clean", "noisy", "filtered"))]
    out = [f"### Curation: a teacher's score on noisy captions (`demo:openmoji-all`, {round(100 * st['noise'])} % of "
           "training captions swapped)", "",
           f"`python scripts/reports/curation.py`: clip, batch 64, {st['steps']} steps for every row; `filtered` keeps "
           f"the top {st['keep_top']:.0%} by the stored score of a teacher trained on the noisy data (the noisy cell "
           "of seed 0); `clean` is the grid's clip cells above. Mean ± sd over "
           f"{summ['noisy'][metrics[0]]['n']} seeds.", "",
           "| data | " + " | ".join(LABELS.get(m, m) for m in metrics) + " |", "|---|" + "---|" * len(metrics)]
    for kind in ("clean", "noisy", "filtered"):
        out.append(f"| {kind} | " + " | ".join(f"{fmt(summ[kind][m]['mean'])} ± {fmt(summ[kind][m]['sd'])}"
                                               for m in metrics) + " |")
    out += ["", f"The filter removed {f['removed']} of the samples; {f['corrupted']} were corrupted: precision "
            f"{f['precision']:.3f}, recall {f['recall']:.3f} (equal because the keep fraction matches the noise "
            f"share); {f['kept_corrupted_share']:.1%} of the kept samples are still corrupted, against "
            f"{st['noise']:.0%} before.", "", "| claim | Δ | bound | verdict |", "|---|---|---|---|"]
    for claim, variant, base, metric, direction in CURATION_CLAIMS:
        if metric not in summ[variant] or metric not in summ[base]:
            continue
        c = compare(summ[variant][metric]["values"], summ[base][metric]["values"], direction)
        out.append(f"| {claim} ({variant} vs {base}, {LABELS.get(metric, metric)}) | {c['delta']:+.3f} | "
                   f"{c['bound']:.3f} | {c['verdict']} |")
    return out + [""]


def block(found: dict[str, dict], supplements: dict[str, dict[str, dict]] | None = None,
          curation: dict | None = None) -> str:
    out: list[str] = []
    for name in DATASETS:
        if name in found and found[name].get("cells"):
            out += section(name, found[name], (supplements or {}).get(name))
        else:
            out += [f"### {DATASETS[name]}", "", "Not run yet.", ""]
    if curation and curation.get("summary"):
        out += curation_section(curation)
    return "\n".join(out).strip() + "\n"


def plot_claims(name: str, data: dict, path: Path) -> None:
    """Per claim, every seed's value of the variant and its baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = {c["batch_size"] for c in data["cells"].values()}  # the grid's batch: the one with most variants
    batch = max(sorted(batches), key=lambda b: len(by_variant(data["cells"], b)))
    groups = by_variant(data["cells"], batch)
    todo = [c for c in CLAIMS if c[1] in groups and (c[2] is None or c[2] in groups)]
    if not todo:
        return
    fig, axes = plt.subplots(1, len(todo), figsize=(2.2 * len(todo), 3.2))
    for ax, (_, variant, base, source, key, _) in zip(list(axes) if len(todo) > 1 else [axes], todo):
        if base is None:
            pairs = [(f"{variant}\npre-proj.", [c["metrics"].get(key[0]) for c in groups[variant]]),
                     (f"{variant}\nprojected", [c["metrics"].get(key[1]) for c in groups[variant]])]
            title = "ARI"
        else:
            pairs = [(v, [cell_value(c, source, key) for c in groups[v]]) for v in (variant, base)]
            title = key.split("/")[-1]
        for i, (_, vals) in enumerate(pairs):
            vals = [v for v in vals if v is not None]
            ax.scatter([i] * len(vals), vals, s=14)
            if vals:
                ax.hlines(statistics.fmean(vals), i - 0.25, i + 0.25)
        ax.set_xticks(range(len(pairs)), [p[0] for p in pairs], fontsize=6)
        ax.set_title(title, fontsize=8)
        ax.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    found = load()
    cur = RESULTS / "curation.json"
    text = block(found, load_supplements(), json.loads(cur.read_text()) if cur.is_file() else None)
    if not args.write:
        print(text, end="")
        return 0
    if not write_block(DOC, START, END, text):
        print(f"error: {DOC} lacks the {START} / {END} markers", file=sys.stderr)
        return 2
    for name, data in found.items():
        if data.get("cells"):
            plot_claims(name, data, RESULTS / f"{name}_claims.png")
    print(f"-> {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
