"""The caption decoder beside the contrastive towers: open_clip's ``CoCa`` (Yu et al., 2022, "CoCa:
Contrastive Captioners are Image-Text Foundation Models"), a causal text decoder (open_clip's
``MultimodalTransformer``) cross-attending to the image tower's tokens, built for an arch with a
``multimodal_cfg`` (``mmpt-tiny-coca``, open_clip's ``coca_ViT-B-32``). ``DualEncoder.forward(...,
caption=True)`` returns :func:`caption_outputs`, which the ``caption`` objective
(:mod:`mmpretrain.losses.caption`) scores.
"""

from __future__ import annotations

import torch
from torch import nn


def is_coca(model_cfg: dict) -> bool:
    """Whether a model config is open_clip's CoCa (a ``multimodal_cfg``: the caption decoder)."""
    return "multimodal_cfg" in model_cfg


def decoder_shape(model_cfg: dict) -> tuple[int, int]:
    """``(context_length, vocab_size)`` of a CoCa config's caption decoder: the tokens it reads and the ids
    it scores (the caption objective's logits are ``(B, context_length - 1, vocab_size)``)."""
    text, mm = model_cfg.get("text_cfg", {}), model_cfg["multimodal_cfg"]
    return text.get("context_length", 77), mm.get("vocab_size", text.get("vocab_size", 49408))


def init_decoder(coca: nn.Module) -> nn.Module:
    """open_clip 3.3's CoCa never initialises its decoder: ``MultimodalTransformer.init_parameters`` reads a
    ``self.transformer`` it does not have, so nothing calls it, and the vocabulary projection stays
    ``torch.empty`` (whatever memory held: zeros, which stop every gradient below it at the first step, or
    garbage; open_clip issue #554). This is that method as written, on the decoder's own width and depth."""
    dec = coca.text_decoder
    proj_std = dec.width ** -0.5 * (2 * dec.layers) ** -0.5
    attn_std, fc_std = dec.width ** -0.5, (2 * dec.width) ** -0.5
    with torch.no_grad():
        for block in [*dec.resblocks, *dec.cross_attn]:
            nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
            nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
            nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        nn.init.normal_(dec.text_projection, std=dec.width ** -0.5)
    return coca


def caption_outputs(coca: nn.Module, images: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """open_clip ``CoCa.forward``'s features for the caption objective: normalised ``image_features`` and
    ``text_features``, the decoder's ``caption_logits (B, L-1, V)`` over the image tokens (the attentional
    pooler's queries) and the text tower's token outputs of ``tokens[:, :-1]``, ``caption_labels =
    tokens[:, 1:]`` (padding, id ``coca.pad_id``, is the objective's to ignore). The same computation as
    ``CoCa.forward``, so ``open_clip.loss.CoCaLoss`` on its outputs is the reference."""
    if not hasattr(coca, "text_decoder"):
        raise ValueError("the caption objective needs a caption decoder: a CoCa arch (a multimodal_cfg, e.g. "
                         "mmpt-tiny-coca or coca_ViT-B-32)")
    image_features, image_tokens = coca._encode_image(images, normalize=True)
    text_features, token_embs = coca._encode_text(tokens, normalize=True)
    return {"image_features": image_features, "text_features": text_features,
            "caption_logits": coca.text_decoder(image_tokens, token_embs[:, :-1]), "caption_labels": tokens[:, 1:]}
