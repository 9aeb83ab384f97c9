"""The README's performance table is the one scripts/perf_table.py generates from bench_results/*.json."""

import subprocess
import sys

from conftest import ROOT


def test_readme_table_matches_the_bench_results():
    table = subprocess.run([sys.executable, str(ROOT / "scripts/perf_table.py")], capture_output=True, text=True,
                           check=True).stdout.strip()
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- perf-table:start -->", 1)[1].split("<!-- perf-table:end -->", 1)[0].strip()
    assert block == table, "README performance table is stale: run python scripts/perf_table.py --write"
    assert table.count("\n") >= 5 and "`python scripts/bench_" in table
