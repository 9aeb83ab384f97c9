"""docs/performance.md's table, generated from bench_results/*.json (each benchmark's JSON: ratio,
target, runs, spread, command).

    python scripts/reports/perf_table.py            print the table
    python scripts/reports/perf_table.py --write    replace the table between docs/performance.md's perf-table markers

``make bench`` runs every scripts/bench/bench_*.py and then this with --write; a test keeps the doc's
table equal to what the committed JSON files say.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench_results"
DOC = ROOT / "docs" / "performance.md"
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"

# what each bench compares (the JSON says how it came out)
WHAT = {
    "train": "training samples/s, `mmpretrain.train` / open_clip_train `main`: same tiny ViT, shards, batch, workers, fp32",
    "loader": "training-stream images/s / open_clip_train `get_wds_dataset` (256 px JPEG shards, 32 px input)",
    "loader_photo": "training-stream images/s / open_clip_train `get_wds_dataset` (photo JPEGs 256-512 px, 224 px input)",
    "loader_photo_limit": "training-stream images/s / the decode limit (Pillow decode + open_clip's crop to uint8, "
                          "as many processes as workers; the loader_photo run)",
    "loader_photo_device_cpu": "`data.decode=device` with the device set to this CPU / `data.decode=worker`, "
                               "images/s (the loader_photo run; the device path is for GPUs: nvJPEG)",
    "loss": "clip tiled / open_clip `ClipLoss`, loss-internal peak memory at B = 16,384",
    "regions": "training step, region-weighted CLIP [5, 10, 20] / plain CLIP (tiny config, k-means every 20 steps)",
    "eval": "zero-shot images/s, `mmpretrain.eval` / clip_benchmark (5,000 MNIST digits)",
    "embed": "`data_tools embed` (sidecars) / raw `SentenceTransformer.encode`, sentences/s, 20,000 captions",
    "teacher_embed": "`data_tools embed --image-model` / the teacher's bare `encode_image` + `encode_text` on the "
                     "same views and captions, images/s (evidence grid's teacher, K = 10)",
    "filter": "k-means fit of `data_tools filter --dedup` (faiss, used) / scikit-learn's KMeans, 100,000 rows of 512, "
              "k = 1,703, 20 iterations (the 2.9 M-row synthetic index; the rules' times in performance.md)",
    "train_global_clip": "training step, `global_clip` (FastCLIP-v3) / plain CLIP, seconds per step (tiny config)",
    "train_objective_cost": "training step, CLIP + 0.5 x `resa` (online) / plain CLIP, seconds per step (tiny config, "
                            "batch 128); momentum `resa` 1.29x and `hard_negatives` 1.52x in the same run",
    "worker_start": "evaluation pass seconds under a process group (zero-shot, 5,000 MNIST digits, 2 workers), workers "
                    "from the fork server / forked from the rank; loader starts that hung, in `extra.hangs`",
    "device_step": "`data.decode=device` crop stage at B = 256 photos (224 px): operator calls per batch, per-image "
                   "(the earlier CUDA path's ops) / batched (Pillow's weights in two matmuls); on this CPU the "
                   "batched stage computes 27x longer (dense products), on a GPU it is off the training thread",
    "caption": "training step, CLIP + 2 x caption / CLIP alone on the same tiny CoCa (the decoder's cost; batch 64, "
               "16 tokens, 49,408-way logits); open_clip's CoCaLoss step beside it in extra, ours 0.55x its time",
    "ssl": "training step past the start, sigmoid + `self_distill` + `masked_prediction` / sigmoid alone (the grid's "
           "tiny ViT, batch 64: 4 local crops of 16 px, half the patches masked, the teacher's forward); + `self_distill` "
           "alone 2.11x; counted on ViT-B-16 (the CC3M recipe's terms) 3.48x the FLOPs; our sigmoid step 1.01x open_clip's",
    "naflex": "NaFlex training patches/s at 64 patches / at 4, the same 1,024-patch budget per step (tiny config; "
              "no anchor: open_clip's NaFlex is unreleased); samples/s per length in docs/naflex.md",
}
ORDER = ["train", "train_global_clip", "train_objective_cost", "caption", "ssl", "loader", "loader_photo", "loader_photo_limit", "loader_photo_device_cpu", "device_step", "loss", "regions", "eval", "worker_start", "embed", "teacher_embed", "filter"]


def fmt(x: float) -> str:
    return f"{x:.2g}" if x < 0.1 else f"{x:.2f}"


def rows() -> list[str]:
    found = {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}
    # only the ratio benches (the schema in docs/performance.md); gpu.json and kmeans_cpu.json are read by their sections
    found = {k: d for k, d in found.items() if {"ratio", "spread", "runs"} <= set(d)}
    out = ["| bench | measured (spread over repeats) | target | command |", "|---|---|---|---|"]
    for name in sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        d = found[name]
        lo, hi = d["spread"]
        better = "higher is better" if d["higher_is_better"] else "lower is better"
        measured = f"**{fmt(d['ratio'])}×** ({fmt(lo)}–{fmt(hi)}, {len(d['runs'])} run{'s' * (len(d['runs']) > 1)})"
        target = "–" if d["target"] is None else f"{'≥' if d['higher_is_better'] else '≤'} {fmt(d['target'])}× ({better})"
        out.append(f"| {name}: {WHAT.get(name, name)} | {measured} | {target} | `{d['command']}` |")
        extra = d.get("extra", {})
        if name == "loss":
            for obj in ("clip", "sigmoid", "soft_target"):
                if obj in extra:
                    e = extra[obj]
                    out.append(f"| loss: {obj} (tiled) memory / time vs its anchor | {fmt(e['memory_ratio'])}× / "
                               f"{fmt(e['time_ratio'])}× | – | `{d['command']}` |")
        for key, label, target in (("soft_target_ratio", "CLIP + soft-target / CLIP, seconds per step", "≤ 1.03×"),
                                   ("regions_ratio", "region-weighted / plain CLIP, seconds per step", "≤ 1.10×")):
            if key in extra:
                runs = extra.get(key + "_runs", [extra[key]])
                out.append(f"| {name}: {label} | **{fmt(extra[key])}×** ({fmt(min(runs))}–{fmt(max(runs))}) | "
                           f"{target} (lower is better) | `{d['command']}` |")
        if name == "train":
            out += _train_rows(extra, d["command"])
    return out


def _train_rows(extra: dict, command: str) -> list[str]:
    """bf16 against fp32 (with the CPU's GEMM rates: native or emulated bf16), and the image-heavy model."""
    out = []
    cpu = extra.get("cpu", {})
    rates = (f"; this CPU: {cpu.get('capability')}, bf16 GEMM {cpu.get('bfloat16_gflops')} vs fp32 "
             f"{cpu.get('float32_gflops')} GFLOP/s" if cpu else "")
    for where, e in (("", extra), (f", image-heavy `{extra.get('image_heavy', {}).get('arch')}`",
                                   extra.get("image_heavy", {}))):
        if "ratio" in e and where:
            runs = e["runs"]
            out.append(f"| train{where}: samples/s, ours / open_clip_train | **{fmt(e['ratio'])}×** "
                       f"({fmt(min(runs))}–{fmt(max(runs))}, {len(runs)} runs) | – | `{command}` |")
        if "bf16_ratio" in e:
            runs, acc = e["bf16_ratio_runs"], e.get("acc1", {})
            out.append(f"| train{where}: `train.precision=bf16` / fp32 samples/s (held-out acc1 "
                       f"{acc.get('ours_bf16', float('nan')):.3f} vs {acc.get('ours', float('nan')):.3f}{rates}) | "
                       f"**{fmt(e['bf16_ratio'])}×** ({fmt(min(runs))}–{fmt(max(runs))}) | – | `{command}` |")
    return out


def table() -> str:
    return "\n".join(rows())


def main() -> int:
    return table_main(__doc__, DOC, START, END, table, "performance table: {n} rows")


def table_main(description: str, doc: Path, start: str, end: str, make, done: str) -> int:
    """A table generator's command line: print ``make()``'s table, or with ``--write`` put it between
    ``doc``'s markers and say so (``done`` formatted with the table's row count ``n``); exit 2 when a
    marker is missing. Shared with config_table.py."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help=f"rewrite {doc.relative_to(ROOT)}'s table")
    args = p.parse_args()
    text = make()
    if not args.write:
        print(text)
        return 0
    if not write_block(doc, start, end, text):
        print(f"error: {doc} lacks the {start} ... {end} markers", file=sys.stderr)
        return 2
    print(f"{doc.relative_to(ROOT)} " + done.format(n=len(text.splitlines()) - 2))
    return 0


def write_block(doc: Path, start: str, end: str, text: str) -> bool:
    """Replace what lies between ``doc``'s ``start`` and ``end`` markers by ``text`` (also used by
    scripts/reports/evidence.py); False, and nothing written, when a marker is missing."""
    old = doc.read_text()
    if start not in old or end not in old:
        return False
    head, rest = old.split(start, 1)
    doc.write_text(f"{head}{start}\n{text.rstrip(chr(10))}\n{end}{rest.split(end, 1)[1]}")
    return True


if __name__ == "__main__":
    sys.exit(main())
