"""open_clip CLIP -> ``transformers.CLIPModel`` (or ``CLIPVisionModelWithProjection``) and ``CLIPProcessor``.

Supported: open_clip ViT image towers (class-token pooling, LayerNorm before and after the
transformer, bias-free projection, no layer scale) and the standard open_clip text transformer
(causal, pooled at the end-of-text token, CLIP's BPE vocabulary). Anything else (ResNet or timm image
towers, Hugging Face text towers, attentional pooling, ...) is refused with what is unsupported:
``transformers`` has no class that computes it. The tokenizer files are generated from open_clip's
own BPE vocabulary, so nothing is downloaded. A NaFlex model (timm ``NaFlexVit`` image tower) is
:mod:`mmpretrain.export.siglip2`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


class Unsupported(ValueError):
    pass


def _check(clip, model_cfg: dict, towers: str) -> list[str]:
    from open_clip.transformer import TextTransformer, VisionTransformer

    problems = []
    v, vc = clip.visual, model_cfg.get("vision_cfg", {})
    if not isinstance(v, VisionTransformer):
        problems.append(f"image tower {type(v).__name__} (only open_clip ViTs map to CLIPVisionModel)")
    else:
        for key, ok in (("timm_model_name", None), ("attentional_pool", False), ("attn_pooler_queries", None),
                        ("ls_init_value", None), ("no_ln_pre", False), ("final_ln_after_pool", False),
                        ("global_average_pool", False)):
            if vc.get(key, ok) not in (ok, None, False):
                problems.append(f"vision_cfg.{key}={vc[key]!r}")
        if vc.get("pool_type", "tok") != "tok":
            problems.append(f"vision_cfg.pool_type={vc['pool_type']!r} (CLIP pools the class token)")
        if not isinstance(getattr(v, "proj", None), torch.Tensor):
            problems.append("the image tower has no plain projection matrix")
    if towers == "both":
        tc = model_cfg.get("text_cfg", {})
        if "hf_model_name" in tc:
            problems.append(f"text tower {tc['hf_model_name']} is a Hugging Face model, not CLIP's text transformer "
                            "(export --towers image for the image encoder alone)")
        elif not isinstance(getattr(clip, "transformer", None), torch.nn.Module) and not isinstance(
                getattr(clip, "text", None), TextTransformer):
            problems.append("no open_clip text transformer")
        else:
            for key, ok in (("ls_init_value", None), ("embed_cls", False), ("proj_bias", False),
                            ("no_causal_mask", False), ("pad_id", 0)):
                if tc.get(key, ok) not in (ok, None, False):
                    problems.append(f"text_cfg.{key}={tc[key]!r}")
            if tc.get("pool_type", "argmax") not in ("argmax", "eos"):
                problems.append(f"text_cfg.pool_type={tc['pool_type']!r} (CLIP pools the end-of-text token)")
            if tc.get("vocab_size", 49408) != 49408 or tc.get("hf_tokenizer_name"):
                problems.append("a tokenizer other than CLIP's BPE")
    return problems


def encoder_layer(p: str, qkv: nn.Linear | tuple, out: nn.Linear, ln1: nn.LayerNorm, ln2: nn.LayerNorm,
                  fc1: nn.Linear, fc2: nn.Linear) -> dict[str, torch.Tensor]:
    """One transformer block's weights under transformers' ``{p}.self_attn / layer_norm1 / layer_norm2 / mlp``
    names (CLIP's and Siglip's encoder layers); ``qkv``: the fused projection's ``(weight, bias)``."""
    weight, bias = qkv
    q, k, v = weight.detach().chunk(3)
    qb, kb, vb = bias.detach().chunk(3)
    return {
        f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.q_proj.bias": qb,
        f"{p}.self_attn.k_proj.weight": k, f"{p}.self_attn.k_proj.bias": kb,
        f"{p}.self_attn.v_proj.weight": v, f"{p}.self_attn.v_proj.bias": vb,
        f"{p}.self_attn.out_proj.weight": out.weight, f"{p}.self_attn.out_proj.bias": out.bias,
        f"{p}.layer_norm1.weight": ln1.weight, f"{p}.layer_norm1.bias": ln1.bias,
        f"{p}.layer_norm2.weight": ln2.weight, f"{p}.layer_norm2.bias": ln2.bias,
        f"{p}.mlp.fc1.weight": fc1.weight, f"{p}.mlp.fc1.bias": fc1.bias,
        f"{p}.mlp.fc2.weight": fc2.weight, f"{p}.mlp.fc2.bias": fc2.bias,
    }


def _layers(prefix_out: str, blocks, sd: dict) -> None:
    """open_clip's residual blocks (fused ``in_proj``) as transformers' encoder layers."""
    for i, b in enumerate(blocks):
        sd.update(encoder_layer(f"{prefix_out}.encoder.layers.{i}", (b.attn.in_proj_weight, b.attn.in_proj_bias),
                                b.attn.out_proj, b.ln_1, b.ln_2, b.mlp.c_fc, b.mlp.c_proj))


def _text_parts(clip):
    """(token_embedding, positional_embedding, transformer, ln_final, text_projection) of either
    open_clip layout (CLIP keeps them on the model, CustomTextCLIP in ``clip.text``)."""
    t = clip.text if hasattr(clip, "text") else clip
    return t.token_embedding, t.positional_embedding, t.transformer, t.ln_final, t.text_projection


def to_transformers(clip, model_cfg: dict, preprocess_cfg: dict, towers: str = "both"):
    """``(model, processor)``: a transformers model with the same weights, and its processor."""
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPTextConfig,
        CLIPVisionConfig,
        CLIPVisionModelWithProjection,
    )

    problems = _check(clip, model_cfg, towers)
    if problems:
        raise Unsupported("--format transformers cannot express this model: " + "; ".join(problems))
    act = "quick_gelu" if model_cfg.get("quick_gelu") else "gelu"
    v, vc = clip.visual, model_cfg["vision_cfg"]
    width = v.conv1.out_channels
    heads = width // vc.get("head_width", 64)
    vision = CLIPVisionConfig(
        hidden_size=width, intermediate_size=int(width * vc.get("mlp_ratio", 4.0)),
        num_hidden_layers=len(v.transformer.resblocks), num_attention_heads=heads,
        image_size=vc["image_size"], patch_size=vc["patch_size"], projection_dim=model_cfg["embed_dim"],
        hidden_act=act, layer_norm_eps=v.ln_pre.eps)
    sd: dict[str, torch.Tensor] = {
        "vision_model.embeddings.class_embedding": v.class_embedding,
        "vision_model.embeddings.patch_embedding.weight": v.conv1.weight,
        "vision_model.embeddings.position_embedding.weight": v.positional_embedding,
        "vision_model.pre_layrnorm.weight": v.ln_pre.weight, "vision_model.pre_layrnorm.bias": v.ln_pre.bias,
        "vision_model.post_layernorm.weight": v.ln_post.weight, "vision_model.post_layernorm.bias": v.ln_post.bias,
        "visual_projection.weight": v.proj.detach().T,
    }
    _layers("vision_model", v.transformer.resblocks, sd)
    size = preprocess_cfg.get("size", vc["image_size"])
    size = size if isinstance(size, int) else max(size)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, do_center_crop=True,
        resample=3, image_mean=list(preprocess_cfg.get("mean", (0.48145466, 0.4578275, 0.40821073))),
        image_std=list(preprocess_cfg.get("std", (0.26862954, 0.26130258, 0.27577711))))
    if towers == "image":
        model = CLIPVisionModelWithProjection(vision)
        _load(model, {k: t for k, t in sd.items()})
        return model.eval(), image_processor
    tc = model_cfg["text_cfg"]
    tok, pos, transformer, ln_final, proj = _text_parts(clip)
    twidth = tok.weight.shape[1]
    text = CLIPTextConfig(
        vocab_size=tok.weight.shape[0], hidden_size=twidth, intermediate_size=int(twidth * tc.get("mlp_ratio", 4.0)),
        num_hidden_layers=len(transformer.resblocks), num_attention_heads=tc.get("heads", 8),
        max_position_embeddings=pos.shape[0], hidden_act=act, layer_norm_eps=ln_final.eps,
        projection_dim=model_cfg["embed_dim"], bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
    sd.update({
        "text_model.embeddings.token_embedding.weight": tok.weight,
        "text_model.embeddings.position_embedding.weight": pos,
        "text_model.final_layer_norm.weight": ln_final.weight, "text_model.final_layer_norm.bias": ln_final.bias,
        "text_projection.weight": proj.weight if isinstance(proj, torch.nn.Linear) else proj.detach().T,
        "logit_scale": clip.logit_scale.detach().reshape(()),
    })
    _layers("text_model", transformer.resblocks, sd)
    model = CLIPModel(CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                 projection_dim=model_cfg["embed_dim"]))
    _load(model, sd)
    return model.eval(), image_processor


def _load(model, sd: dict[str, torch.Tensor]) -> None:
    ours = {k: t.detach().clone().contiguous() for k, t in sd.items()}
    missing, unexpected = model.load_state_dict(ours, strict=False)
    missing = [m for m in missing if not m.endswith("position_ids")]
    if missing or unexpected:
        raise Unsupported(f"weight mapping incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}")


def write_clip_tokenizer(out: Path, context_length: int, pad_token: str = "<|endoftext|>") -> None:
    """``vocab.json``, ``merges.txt`` and the tokenizer config of CLIP's BPE, from open_clip's file;
    ``pad_token``: CLIP pads with end-of-text (read at the first one), a last-position text tower with id 0
    (``!``), as open_clip's tokenizer pads in training."""
    from open_clip.tokenizer import SimpleTokenizer

    st = SimpleTokenizer()
    special = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    vocab = {special.get(k, k): v for k, v in st.encoder.items()}
    merges = [" ".join(pair) for pair, _ in sorted(st.bpe_ranks.items(), key=lambda kv: kv[1])]
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt"), model_max_length=context_length,
                        pad_token=pad_token, padding_side="right")
    tok.save_pretrained(str(out))


def save_transformers(clip, model_cfg: dict, preprocess_cfg: dict, out: Path, towers: str = "both") -> None:
    model, image_processor = to_transformers(clip, model_cfg, preprocess_cfg, towers)
    model.save_pretrained(str(out), safe_serialization=True)
    image_processor.save_pretrained(str(out))
    if towers == "both":
        from transformers import CLIPProcessor, CLIPTokenizer

        # here, not at the top: the factory imports open_clip, which the export's --help does without
        from mmpretrain.models.factory import CONTEXT_LENGTH

        write_clip_tokenizer(out, model_cfg["text_cfg"].get("context_length", CONTEXT_LENGTH))
        CLIPProcessor(image_processor=image_processor, tokenizer=CLIPTokenizer.from_pretrained(str(out))
                      ).save_pretrained(str(out))
