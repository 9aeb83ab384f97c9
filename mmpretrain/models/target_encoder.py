"""The frozen sentence-transformer that produces caption embeddings (similarity targets), and the
choice between embeddings stored with the shards and computing them online."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from mmpretrain.hub_cache import local_only, quiet_load

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


def load_target_encoder(model: str, device: str) -> SentenceTransformer:
    # sentence-transformers adds ~2.4 s to the trainer's start; only online targets need it
    from sentence_transformers import SentenceTransformer

    with quiet_load():
        return SentenceTransformer(str(model), device=device, **local_only()).eval()


def choose_target_source(requested: Literal["auto", "shards", "online"], model: str, recorded: set[str | None],
                         needed: bool, text_from_targets: bool) -> Literal["shards", "online", "none"]:
    """Where target embeddings come from: ``"shards"``, ``"online"`` or ``"none"`` (not ``needed``).
    ``recorded``: the embedding model each training source's manifest records (None: not embedded).
    Raises ValueError, naming the fix, when the request cannot be met."""
    if not needed:
        return "none"
    in_shards = recorded == {model}
    if requested == "shards" and not in_shards:
        raise ValueError(
            f"targets.source=shards but the shards of data.train carry embeddings of {sorted(map(str, recorded))}, "
            f"not {model!r}: run `python -m data_tools embed DIR --model {model}` or set targets.source=online"
        )
    if requested == "online" or not in_shards:
        if text_from_targets:
            raise ValueError(
                "model.text_from_targets=true needs embeddings stored in the shards: run "
                f"`python -m data_tools embed DIR --model {model}`"
            )
        return "online"
    return "shards"
