"""The generated tables of the docs equal what their generators print: docs/performance.md from bench_results/*.json
(scripts/reports/perf_table.py), docs/config.md's config keys from the config's sections (config_table.py), the
README's demo table from the recorded make demo run (demo_table.py)."""

import subprocess
import sys

import pytest

from conftest import ROOT


def _generated(script: str, doc: str, marker: str) -> tuple[str, str]:
    """What ``script`` prints, and what ``doc`` holds between its ``marker`` start/end comments."""
    table = subprocess.run([sys.executable, str(ROOT / "scripts/reports" / script)], capture_output=True,
                           text=True, check=True).stdout.strip()
    text = (ROOT / "docs" / doc).read_text()
    return table, text.split(f"<!-- {marker}:start -->", 1)[1].split(f"<!-- {marker}:end -->", 1)[0].strip()


@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_performance_table_matches_the_bench_results():
    table, block = _generated("perf_table.py", "performance.md", "perf-table")
    assert block == table, "docs/performance.md's table is stale: run python scripts/reports/perf_table.py --write"
    assert table.count("\n") >= 5 and "`python scripts/bench/bench_" in table


@pytest.mark.integration  # starts processes (or builds real data): not in make test-unit
def test_usage_config_table_lists_every_key():
    table, block = _generated("config_table.py", "config.md", "config-table")
    assert block == table, "docs/config.md's config table is stale: run python scripts/reports/config_table.py --write"
    from mmpretrain.config import config_defaults

    listed = {line.split("`")[1] for line in table.splitlines()[2:]}
    assert set(config_defaults()) - {"loss"} <= listed | {k.split(".")[0] for k in listed}, "a key without its row"


@pytest.mark.integration  # starts a process: not in make test-unit
def test_readme_demo_table_is_the_recorded_run():
    """README's demo table is what scripts/reports/demo_table.py prints from bench_results/demo.json (the
    recorded make demo run's results.json)."""
    table = subprocess.run([sys.executable, str(ROOT / "scripts/reports/demo_table.py")], capture_output=True,
                           text=True, check=True).stdout.strip()
    block = (ROOT / "README.md").read_text().split("<!-- demo-table:start -->", 1)[1].split(
        "<!-- demo-table:end -->", 1)[0].strip()
    assert block == table, "README's demo table is stale: run python scripts/reports/demo_table.py --from " \
                           "runs/demo/results.json --write after make demo"
    assert "| acc1 | 0." in table and "retrieval, 264 pairs" in table
