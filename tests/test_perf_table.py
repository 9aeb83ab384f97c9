"""The generated tables of the docs equal what their generators print: docs/performance.md from bench_results/*.json
(scripts/reports/perf_table.py), docs/usage.md's config keys from the config's sections (config_table.py)."""

import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_performance_table_matches_the_bench_results():
    table = subprocess.run([sys.executable, str(ROOT / "scripts/reports/perf_table.py")], capture_output=True,
                           text=True, check=True).stdout.strip()
    doc = (ROOT / "docs/performance.md").read_text()
    block = doc.split("<!-- perf-table:start -->", 1)[1].split("<!-- perf-table:end -->", 1)[0].strip()
    assert block == table, "docs/performance.md's table is stale: run python scripts/reports/perf_table.py --write"
    assert table.count("\n") >= 5 and "`python scripts/bench/bench_" in table


@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_usage_config_table_lists_every_key():
    table = subprocess.run([sys.executable, str(ROOT / "scripts/reports/config_table.py")], capture_output=True,
                           text=True, check=True).stdout.strip()
    doc = (ROOT / "docs/usage.md").read_text()
    block = doc.split("<!-- config-table:start -->", 1)[1].split("<!-- config-table:end -->", 1)[0].strip()
    assert block == table, "docs/usage.md's config table is stale: run python scripts/reports/config_table.py --write"
    from mmpretrain.config import config_defaults

    listed = {line.split("`")[1] for line in table.splitlines()[2:]}
    assert set(config_defaults()) - {"loss"} <= listed | {k.split(".")[0] for k in listed}, "a key without its row"
