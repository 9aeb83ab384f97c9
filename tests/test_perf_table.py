"""docs/performance.md's table is the one scripts/reports/perf_table.py generates from bench_results/*.json."""

import subprocess
import sys

from conftest import ROOT


def test_performance_table_matches_the_bench_results():
    table = subprocess.run([sys.executable, str(ROOT / "scripts/reports/perf_table.py")], capture_output=True,
                           text=True, check=True).stdout.strip()
    doc = (ROOT / "docs/performance.md").read_text()
    block = doc.split("<!-- perf-table:start -->", 1)[1].split("<!-- perf-table:end -->", 1)[0].strip()
    assert block == table, "docs/performance.md's table is stale: run python scripts/reports/perf_table.py --write"
    assert table.count("\n") >= 5 and "`python scripts/bench/bench_" in table
