"""The text tower over a batch's used columns only: open_clip pads every caption to its context length and
runs the transformer over the padding, which a causal tower with EOT pooling never reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from open_clip.transformer import text_global_pool
from torch import nn


def trims_text(clip: nn.Module) -> bool:
    """Whether dropping trailing padding leaves the pooled text feature unchanged: an open_clip text
    transformer under its causal mask (no position sees a later one) with EOT (argmax/eos) or
    first-token pooling. Not for towers without a causal mask, last-token pooling or HF towers."""
    return (getattr(clip, "attn_mask", None) is not None and hasattr(clip, "token_embedding")
            and getattr(clip, "text_pool_type", None) in ("argmax", "eos", "first"))


def trim_padding(tokens: torch.Tensor, multiple: int = 1) -> torch.Tensor:
    """``tokens (B, L)`` without the trailing columns that are padding (0) in every row (at least one
    column), the length rounded up to a ``multiple`` (at most ``L``): few distinct shapes, so that
    ``torch.compile`` does not recompile for every batch. Call it on the host copy of the batch: the
    length is data-dependent, and read on a device it would be a synchronisation every step."""
    return tokens[:, : padded_length(tokens, multiple)]


def padded_length(tokens: torch.Tensor, multiple: int = 1) -> int:
    """The columns :func:`trim_padding` keeps (read on the host copy, as it is)."""
    used = (tokens != 0).any(0).nonzero()
    length = int(used.max()) + 1 if used.numel() else 1
    return min(-(-length // multiple) * multiple, tokens.shape[1])


def encode_text_trimmed(clip: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``clip.encode_text(tokens, normalize=True)`` for ``tokens (B, L)`` cut to their used columns
    (:func:`trim_padding`), ``L`` up to the context. open_clip pads every caption to
    ``context_length`` (77 for CLIP, 32 for the tiny towers) and runs the text transformer over the
    padding; where :func:`trims_text` holds, running over the first ``L`` positions only (positional
    embedding and causal mask cut to ``L``) is the same function at a fraction of the cost (tested to
    1e-12 in value and gradient). Other towers, and full-length tokens, run ``encode_text`` unchanged."""
    length = tokens.shape[1] if tokens.dim() == 2 else None
    if not trims_text(clip) or length is None or length >= clip.positional_embedding.shape[0]:
        return clip.encode_text(tokens, normalize=True)
    cast = clip.transformer.get_cast_dtype()
    x = clip.token_embedding(tokens).to(cast) + clip.positional_embedding[:length].to(cast)
    x = clip.transformer(x, attn_mask=clip.attn_mask[:length, :length])
    x = text_global_pool(clip.ln_final(x), tokens, clip.text_pool_type, eos_token_id=getattr(clip, "text_eos_id", None))
    if clip.text_projection is not None:
        x = clip.text_projection(x) if isinstance(clip.text_projection, nn.Linear) else x @ clip.text_projection
    return F.normalize(x, dim=-1)
