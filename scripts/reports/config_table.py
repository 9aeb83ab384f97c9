"""docs/config.md's table of every config key, generated from the config's own sections
(mmpretrain/config/reference.py).

    python scripts/reports/config_table.py            print the table
    python scripts/reports/config_table.py --write    replace the table between docs/config.md's config-table markers

A test keeps the doc's table equal to what this prints: a key added to the config without its row fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mmpretrain.config.reference import table

from perf_table import table_main  # this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"
START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def main() -> int:
    return table_main(__doc__, DOC, START, END, table, "config table: {n} keys")


if __name__ == "__main__":
    sys.exit(main())
