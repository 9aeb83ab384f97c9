"""docs/usage.md's table of every config key, generated from the config's own sections
(mmpretrain/config/reference.py).

    python scripts/reports/config_table.py            print the table
    python scripts/reports/config_table.py --write    replace the table between docs/usage.md's config-table markers

A test keeps the doc's table equal to what this prints: a key added to the config without its row fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmpretrain.config.reference import table

from perf_table import write_block  # this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "usage.md"
START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite docs/usage.md's table")
    text = table()
    if not p.parse_args().write:
        print(text)
        return 0
    if not write_block(DOC, START, END, text):
        print(f"error: {DOC} lacks the {START} ... {END} markers", file=sys.stderr)
        return 2
    print(f"{DOC.relative_to(ROOT)} config table: {len(text.splitlines()) - 2} keys")
    return 0


if __name__ == "__main__":
    sys.exit(main())
