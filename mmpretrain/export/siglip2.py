"""A NaFlex model (timm ``NaFlexVit`` image tower, SigLIP-style open_clip text tower) ->
``transformers.Siglip2Model`` + ``Siglip2ImageProcessor``.

The two compute the same functions: timm's learned position table resized per image with bilinear,
antialiased interpolation (``pos_embed_interp_mode: bilinear``) is Siglip2's ``resize_positional_embeddings``;
timm's attention pool (a latent query, fused key-value projection, an MLP after a LayerNorm) is Siglip2's
``MultiheadAttentionPoolingHead``; the text tower (no causal mask, the last position pooled, a biased
projection) is Siglip's text model. What the mapping cannot carry is refused with what it is. The image
processor sizes and patchifies as :mod:`mmpretrain.data.naflex` does; the tokenizer is CLIP's BPE
(the tower's vocabulary), written from open_clip's own file, with captions padded to the context as in
training (``padding="max_length"``: the last position is read).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mmpretrain.export.hf import Unsupported, _layers, _load, _text_parts, encoder_layer, write_clip_tokenizer


class _DefaultVocabCheck(logging.Filter):
    """transformers' special-token check run against Siglip2TextConfig's default 32,000-token vocabulary
    while a config is serialised (CLIP's start and end ids, 49406 and 49407, lie in the real one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "between 0 and 31999" not in record.getMessage()


@contextmanager
def saving() -> Iterator[None]:
    """Around ``save_pretrained`` of a Siglip2 export: without the spurious vocabulary warning."""
    log, check = logging.getLogger("transformers.configuration_utils"), _DefaultVocabCheck()
    log.addFilter(check)
    try:
        yield
    finally:
        log.removeFilter(check)


def _check(clip, model_cfg: dict, towers: str) -> list[str]:
    problems = []
    vc, tc = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    trunk = getattr(clip.visual, "trunk", None)
    embeds = getattr(trunk, "embeds", None)
    if embeds is None or getattr(trunk, "attn_pool", None) is None:
        problems.append("the image tower is not a NaFlexVit with attention pooling (vision_cfg.timm_pool: map)")
        return problems
    if vc.get("timm_proj", "linear") not in ("none", "", None):
        problems.append(f"vision_cfg.timm_proj={vc.get('timm_proj')!r} (Siglip2's image feature is the pooled output)")
    if trunk.embeds.pos_embed is None or trunk.embeds.pos_embed.shape[1] != trunk.embeds.pos_embed.shape[2]:
        problems.append("a position table that is not square (Siglip2 keeps a square one)")
    if getattr(embeds, "pos_embed_use_grid_sample", False) or getattr(embeds, "pos_embed_interp_mode", "") != "bilinear":
        problems.append("position interpolation other than bilinear F.interpolate (Siglip2's)")
    if getattr(embeds, "cls_token", None) is not None or getattr(embeds, "reg_token", None) is not None:
        problems.append("class or register tokens")
    if not isinstance(trunk.norm_pre, torch.nn.Identity) or not isinstance(trunk.fc_norm, torch.nn.Identity):
        problems.append("a LayerNorm before the blocks or after the pool")
    if towers == "both":
        if "hf_model_name" in tc:
            problems.append(f"text tower {tc['hf_model_name']} is a Hugging Face model, not Siglip's text transformer")
        if tc.get("pool_type") != "last" or not tc.get("no_causal_mask") or not tc.get("proj_bias"):
            problems.append("the text tower must pool the last position without a causal mask through a biased "
                            "projection (text_cfg pool_type: last, no_causal_mask: true, proj_bias: true)")
        if tc.get("vocab_size", 49408) != 49408 or tc.get("hf_tokenizer_name"):
            problems.append("a tokenizer other than CLIP's BPE")
        if model_cfg["embed_dim"] != embeds.proj.out_features:
            problems.append(f"embed_dim {model_cfg['embed_dim']} is not the image width {embeds.proj.out_features} "
                            "(Siglip2's image feature is the pooled output, unprojected)")
    return problems


def _vision_state(trunk) -> dict[str, torch.Tensor]:
    e, pool = trunk.embeds, trunk.attn_pool
    d = e.proj.out_features
    sd = {
        "vision_model.embeddings.patch_embedding.weight": e.proj.weight,
        "vision_model.embeddings.patch_embedding.bias": e.proj.bias,
        "vision_model.embeddings.position_embedding.weight": e.pos_embed.detach().reshape(-1, d),
        "vision_model.post_layernorm.weight": trunk.norm.weight, "vision_model.post_layernorm.bias": trunk.norm.bias,
        "vision_model.head.probe": pool.latent,
        "vision_model.head.attention.in_proj_weight": torch.cat([pool.q.weight, pool.kv.weight]),
        "vision_model.head.attention.in_proj_bias": torch.cat([pool.q.bias, pool.kv.bias]),
        "vision_model.head.attention.out_proj.weight": pool.proj.weight,
        "vision_model.head.attention.out_proj.bias": pool.proj.bias,
        "vision_model.head.layernorm.weight": pool.norm.weight, "vision_model.head.layernorm.bias": pool.norm.bias,
        "vision_model.head.mlp.fc1.weight": pool.mlp.fc1.weight, "vision_model.head.mlp.fc1.bias": pool.mlp.fc1.bias,
        "vision_model.head.mlp.fc2.weight": pool.mlp.fc2.weight, "vision_model.head.mlp.fc2.bias": pool.mlp.fc2.bias,
    }
    for i, b in enumerate(trunk.blocks):  # timm's blocks: fused qkv, attn.proj, norm1/norm2, mlp.fc1/fc2
        sd.update(encoder_layer(f"vision_model.encoder.layers.{i}", (b.attn.qkv.weight, b.attn.qkv.bias),
                                b.attn.proj, b.norm1, b.norm2, b.mlp.fc1, b.mlp.fc2))
    return sd


def to_siglip2(clip, model_cfg: dict, preprocess_cfg: dict, towers: str = "both", max_patches: int = 256):
    """``(model, image_processor)``: ``Siglip2Model`` (``Siglip2VisionModel`` for ``towers="image"``) with
    the same weights, and a ``Siglip2ImageProcessor`` at ``max_patches`` patches (its default length)."""
    from transformers import (
        Siglip2Config,
        Siglip2ImageProcessor,
        Siglip2Model,
        Siglip2VisionConfig,
        Siglip2VisionModel,
    )

    problems = _check(clip, model_cfg, towers)
    if problems:
        raise Unsupported("--format transformers cannot express this NaFlex model as Siglip2: " + "; ".join(problems)
                          + ("" if towers == "image" else " (export --towers image for the image tower alone)"))
    trunk = clip.visual.trunk
    e, blocks = trunk.embeds, trunk.blocks
    width, side = e.proj.out_features, e.pos_embed.shape[1]
    patch = e.patch_size[0] if isinstance(e.patch_size, (tuple, list)) else int(e.patch_size)
    vision = Siglip2VisionConfig(
        hidden_size=width, intermediate_size=blocks[0].mlp.fc1.out_features, num_hidden_layers=len(blocks),
        num_attention_heads=blocks[0].attn.num_heads, num_channels=3, num_patches=side * side, patch_size=patch,
        hidden_act="gelu_pytorch_tanh", layer_norm_eps=trunk.norm.eps)
    sd = _vision_state(trunk)
    processor = Siglip2ImageProcessor(
        patch_size=patch, max_num_patches=max_patches, resample=2,  # PIL bilinear, as mmpretrain.data.naflex
        image_mean=list(preprocess_cfg.get("mean", (0.5, 0.5, 0.5))),
        image_std=list(preprocess_cfg.get("std", (0.5, 0.5, 0.5))))
    if towers == "image":
        model = Siglip2VisionModel(vision)
        if not any(k.startswith("vision_model.") for k in model.state_dict()):  # transformers 5.23 flattened it
            sd = {k.removeprefix("vision_model."): t for k, t in sd.items()}
        _load(model, sd)
        return model.eval(), processor
    from transformers import Siglip2TextConfig

    tok, pos, transformer, ln_final, proj = _text_parts(clip)
    twidth = tok.weight.shape[1]
    text = Siglip2TextConfig(
        vocab_size=tok.weight.shape[0], hidden_size=twidth, intermediate_size=transformer.resblocks[0].mlp.c_fc.out_features,
        num_hidden_layers=len(transformer.resblocks), num_attention_heads=transformer.resblocks[0].attn.num_heads,
        max_position_embeddings=pos.shape[0], hidden_act="gelu_pytorch_tanh", layer_norm_eps=ln_final.eps,
        projection_size=model_cfg["embed_dim"], pad_token_id=0, bos_token_id=49406, eos_token_id=49407)
    sd.update({
        "text_model.embeddings.token_embedding.weight": tok.weight,
        "text_model.embeddings.position_embedding.weight": pos,
        "text_model.final_layer_norm.weight": ln_final.weight, "text_model.final_layer_norm.bias": ln_final.bias,
        "text_model.head.weight": proj.weight, "text_model.head.bias": proj.bias,
        "logit_scale": clip.logit_scale.detach().reshape(1),
        "logit_bias": (clip.logit_bias.detach() if clip.logit_bias is not None else torch.zeros(())).reshape(1),
    })
    _layers("text_model", transformer.resblocks, sd)
    model = Siglip2Model(Siglip2Config(text_config=text.to_dict(), vision_config=vision.to_dict()))
    _load(model, sd)
    return model.eval(), processor


def save_siglip2(clip, model_cfg: dict, preprocess_cfg: dict, out, towers: str = "both") -> None:
    """``Siglip2Model`` (or ``Siglip2VisionModel``), its ``Siglip2ImageProcessor`` at
    ``preprocess_cfg["naflex_seq_len"]`` patches (default 256) and CLIP's tokenizer into ``out``. No
    ``Siglip2Processor``: it loads its tokenizer as Gemma's class, which cannot read CLIP's BPE, and so does
    ``AutoTokenizer`` for a siglip2 folder; read the folder with ``AutoImageProcessor`` + ``CLIPTokenizer``."""
    model, image_processor = to_siglip2(clip, model_cfg, preprocess_cfg, towers,
                                        max_patches=preprocess_cfg.get("naflex_seq_len", 256))
    with saving():
        model.save_pretrained(str(out), safe_serialization=True)
    image_processor.save_pretrained(str(out))
    if towers == "both":
        from mmpretrain.models.factory import CONTEXT_LENGTH

        # padded with id 0 ("!"), as open_clip's tokenizer pads in training: the last position is read
        write_clip_tokenizer(out, model_cfg["text_cfg"].get("context_length", CONTEXT_LENGTH), pad_token="!")

