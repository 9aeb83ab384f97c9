"""The frozen sentence-transformer that produces caption embeddings (similarity targets), and the
choice between embeddings stored in the shards and computing them online."""

from __future__ import annotations

from pathlib import Path

from mmpretrain.config import ConfigError, ExperimentConfig
from mmpretrain.data.manifest import read_manifest


def load_target_encoder(model: str, device: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model), device=device).eval()


def target_plan(cfg: ExperimentConfig, urls: list[str], needs_targets: bool) -> str:
    """Where target embeddings come from: "shards", "online" or "none"."""
    if not needs_targets:
        return "none"
    from mmpretrain.data.sources import shard_path

    folders = {str(Path(shard_path(u)).parent) for u in urls}
    recorded = {(read_manifest(f).get("embedding") or {}).get("model") for f in folders}
    in_shards = recorded == {cfg.targets.model}
    if cfg.targets.source == "shards" and not in_shards:
        raise ConfigError(
            f"targets.source=shards but the shards of data.train carry embeddings of {sorted(map(str, recorded))}, "
            f"not {cfg.targets.model!r}: run `python -m data_tools embed DIR --model {cfg.targets.model}` "
            "or set targets.source=online"
        )
    if cfg.targets.source == "online" or not in_shards:
        if cfg.model.text_from_targets:
            raise ConfigError(
                "model.text_from_targets=true needs embeddings stored in the shards: run "
                f"`python -m data_tools embed DIR --model {cfg.targets.model}`"
            )
        return "online"
    return "shards"
