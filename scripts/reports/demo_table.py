"""The README's demo table, generated from `make demo`'s own results.json (no number typed by hand).

    python scripts/reports/demo_table.py                         print the table from bench_results/demo.json
    python scripts/reports/demo_table.py --from runs/demo/results.json
                                                                  print it from a fresh `make demo` (make demo does)
    python scripts/reports/demo_table.py --from runs/demo/results.json --write
                                                                  record that run in bench_results/demo.json and
                                                                  rewrite the README's table between its markers

bench_results/demo.json holds the entries of the recorded run's results.json, the CPU it ran on, and
the figures an earlier kind of CPU printed (the second value column, kept as recorded). A test keeps
the README's block equal to what this prints.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from perf_table import write_block  # this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "bench_results" / "demo.json"
DOC = ROOT / "README.md"
START, END = "<!-- demo-table:start -->", "<!-- demo-table:end -->"
RECALLS = ("1", "5", "10")


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX-512 BF16 (what decides the kernels torch picks)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return f"{model}{', AVX-512 BF16' if 'avx512_bf16' in flags else ''}" or "unknown CPU"


def _by_task(results: list[dict]) -> dict[str, dict]:
    return {e["task"]: e for e in results}


def table(record: dict) -> str:
    tasks, other = _by_task(record["results"]), record.get("other_cpus", {})
    cls, ret = tasks["zeroshot_classification"], tasks["zeroshot_retrieval"]
    label = record.get("cpu_label", record["cpu"])
    rows = [f"| task (held-out) | metric | value: {label} | value: {other.get('label', 'other CPUs')} | chance | "
            f"× chance ({label.split(',')[0]}) |", "|---|---|---|---|---|---|"]
    for i, k in enumerate(("acc1", "acc5", "mean_per_class_recall")):
        v, ch = cls["metrics"][k], cls["chance"][k]
        classes = round(1 / cls["chance"]["acc1"])  # chance acc1 is 1 / classes
        task = f"zero-shot classification, {classes} classes, {cls['n']} images" if not i else ""
        rows.append(f"| {task} | {k} | {v:.3f} | {other.get(k, '-')} | {ch:.4g} | {v / ch:.1f} |")
    for i, side in enumerate(("image", "text")):
        keys = [f"{side}_retrieval_recall@{k}" for k in RECALLS]
        vals, chance = [ret["metrics"][k] for k in keys], [ret["chance"][k] for k in keys]
        task = f"retrieval, {ret['n']} pairs" if not i else ""
        rows.append(f"| {task} | {side}_retrieval_recall@1 / @5 / @10 | {' / '.join(f'{v:.3f}' for v in vals)} | "
                    f"{other.get(side + '_retrieval_recall', '-')} | {' / '.join(f'{c:.3f}' for c in chance)} | "
                    f"{' / '.join(f'{v / c:.0f}' for v, c in zip(vals, chance))} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", default=None, help="a make demo results.json (default: the recorded run)")
    p.add_argument("--write", action="store_true", help="record --from in bench_results/demo.json and rewrite the README")
    args = p.parse_args()
    record = json.loads(RECORD.read_text())
    if args.source:
        try:
            results = json.loads(Path(args.source).read_text())["results"]
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --from {args.source}: not a results.json of make demo ({e})", file=sys.stderr)
            return 2
        cpu = cpu_name()
        label = record.get("cpu_label") if cpu == record.get("cpu") else cpu
        record = {**record, "results": [{k: e[k] for k in ("dataset", "task", "n", "metrics", "chance")}
                                        for e in results], "cpu": cpu, "cpu_label": label}
    text = table(record)
    if not args.write:
        print(text)
        return 0
    if not args.source:
        print("error: --write records a run: give --from runs/demo/results.json", file=sys.stderr)
        return 2
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    if not write_block(DOC, START, END, text):
        print(f"error: {DOC} lacks the {START} ... {END} markers", file=sys.stderr)
        return 2
    print(f"-> {RECORD.relative_to(ROOT)}, README.md's demo table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
