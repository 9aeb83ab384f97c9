"""Build image/text towers through open_clip; load trained models from run and export folders.

A model is described by an open_clip ``model_cfg`` dict plus a ``preprocess_cfg`` dict, exactly the
two halves of open_clip's ``open_clip_config.json``; the run folder keeps that file
(``model_config.json``, :mod:`mmpretrain.run_files`), so a checkpoint never loses the architecture it
was trained with.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import types
import typing
from dataclasses import asdict
from pathlib import Path
from pickle import UnpicklingError  # the exception only: weights load through safetensors or weights_only

import open_clip
import torch
import torch.nn.functional as F
from huggingface_hub import hf_hub_download
from open_clip.transform import PreprocessCfg
from safetensors.torch import load_file
from torch import nn

from mmpretrain.hub_cache import quiet_load
from mmpretrain.models import (
    naflex,  # noqa: F401  (registers mmpt_naflexvit_tiny with timm)
    patch_dropout,
)
from mmpretrain.models.caption import caption_outputs, init_decoder, is_coca
from mmpretrain.models.ssl import SelfSupervised, SslInputs, student_outputs
from mmpretrain.models.text import encode_text_trimmed
from mmpretrain.run_files import MODEL_WEIGHTS, RunFolder, checkpoint_clip_weights

PACKAGED_CONFIGS = Path(__file__).resolve().parent.parent / "model_configs"
#: open_clip's text context when a text_cfg names none (CLIP's 77 tokens)
CONTEXT_LENGTH = 77
_registered = False


def register_packaged_configs() -> None:
    """Make the packaged tiny architectures (``mmpt-*``) known to open_clip by name."""
    global _registered
    if not _registered:
        open_clip.add_model_config(PACKAGED_CONFIGS)
        _registered = True


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def is_hf_text(model_cfg: dict) -> bool:
    return "hf_model_name" in model_cfg.get("text_cfg", {})


def resolve_model_cfg(arch: str, text_model: str | None = None, overrides: dict | None = None) -> dict:
    """The open_clip model config actually trained: the named arch, overrides merged in."""
    register_packaged_configs()
    cfg = open_clip.get_model_config(arch)
    if cfg is None:
        raise ValueError(
            f"model.arch={arch!r} is not an open_clip architecture; choose one of open_clip.list_models() "
            f"(packaged tiny ones: {sorted(p.stem for p in PACKAGED_CONFIGS.glob('*.json'))})"
        )
    check_overrides(overrides or {})
    if "multimodal_cfg" in (overrides or {}) and not is_coca(cfg):
        raise ValueError(f"model.overrides.multimodal_cfg: model.arch={arch!r} has no caption decoder to change; "
                         "use a CoCa arch (mmpt-tiny-coca, coca_ViT-B-32)")
    cfg = _deep_merge(cfg, overrides or {})
    if text_model is not None:
        if not is_hf_text(cfg):
            raise ValueError(
                f"model.text_model is set but arch {arch!r} has no Hugging Face text tower; "
                "use an arch with text_cfg.hf_model_name (e.g. mmpt-tiny-vit-minilm)"
            )
        cfg["text_cfg"]["hf_model_name"] = text_model
        cfg["text_cfg"]["hf_tokenizer_name"] = text_model
    return cfg


_TOWER_CFGS = {"vision_cfg": open_clip.CLIPVisionCfg, "text_cfg": open_clip.CLIPTextCfg,
               "multimodal_cfg": open_clip.coca_model.MultimodalCfg}  # a CoCa arch's caption decoder


def _type_ok(value, hint) -> bool:
    """Whether a YAML value fits a dataclass field's type (types this does not know: assumed to)."""
    if hint in (int, float, str, bool):
        if isinstance(value, bool):
            return hint is bool
        return isinstance(value, (int, float)) if hint is float else isinstance(value, hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(value is None if a is type(None) else _type_ok(value, a) for a in typing.get_args(hint))
    if origin in (tuple, list):
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    return True


def check_overrides(overrides: dict) -> None:
    """``model.overrides`` keys must be open_clip's (the model's arguments, ``vision_cfg``/``text_cfg``
    fields) with values of their types; a misspelt key would be a TypeError deep in open_clip."""
    top = set().union(*(inspect.signature(m.__init__).parameters for m in (
        open_clip.CLIP, open_clip.CustomTextCLIP, open_clip.CoCa))) | {"custom_text"}
    top -= {"self", "args", "kwargs"}
    for key, value in overrides.items():
        if key not in top:
            raise ValueError(f"model.overrides.{key}: not an open_clip model setting; choose one of {sorted(top)}")
        if key in _TOWER_CFGS:
            if not isinstance(value, dict):
                raise ValueError(f"model.overrides.{key}: must be a mapping of {_TOWER_CFGS[key].__name__} fields")
            hints = typing.get_type_hints(_TOWER_CFGS[key])
            names = [f.name for f in dataclasses.fields(_TOWER_CFGS[key])]
            for k, v in value.items():
                if k not in names:
                    near = [n for n in names if n[:3] == k[:3]]
                    raise ValueError(f"model.overrides.{key}.{k}: not a field of open_clip's "
                                     f"{_TOWER_CFGS[key].__name__}{f' (did you mean {near[0]}?)' if near else ''}")
                if not _type_ok(v, hints[k]):
                    kind = str(hints[k]).replace("typing.", "")
                    raise ValueError(f"model.overrides.{key}.{k}={v!r}: must be of type {kind}")
        elif key == "embed_dim" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"model.overrides.embed_dim={value!r}: must be a positive whole number")


def default_preprocess_cfg(model_cfg: dict) -> dict:
    return asdict(PreprocessCfg(size=model_cfg["vision_cfg"]["image_size"]))


def instantiate(model_cfg: dict, load_text_weights: bool, nonscalar_logit_scale: bool = False) -> nn.Module:
    """An open_clip ``CLIP`` or ``CustomTextCLIP`` from a config dict (as open_clip's factory does).
    ``load_text_weights`` loads the HF text tower's pretrained weights (training from scratch);
    when a full checkpoint follows, only its config is needed. ``nonscalar_logit_scale``: the scale
    and bias as 1-element vectors (FSDP refuses 0-dim parameters); saved weights are always 0-dim
    (:func:`scalar_logits`), so the config written beside them does not carry it."""
    cfg = copy.deepcopy(model_cfg)
    hf = is_hf_text(cfg)
    if hf:
        cfg["text_cfg"]["hf_model_pretrained"] = load_text_weights
    custom = cfg.pop("custom_text", False) or hf
    # a multimodal_cfg: open_clip's CoCa (a caption decoder over the image tower's tokens; the caption objective)
    cls = open_clip.CoCa if is_coca(cfg) else open_clip.CustomTextCLIP if custom else open_clip.CLIP
    if nonscalar_logit_scale:
        cfg["nonscalar_logit_scale"] = True
    with quiet_load():  # the HF tower's load: no progress bar, no report of the unused pooler weights
        model = cls(**cfg)
    return init_decoder(model) if cls is open_clip.CoCa else model


LOGIT_KEYS = ("logit_scale", "logit_bias")


def scalar_logits(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with the logit scale and bias as 0-dim tensors (open_clip's layout), whatever
    the prefix (``clip.`` in checkpoints) and whether the model was built with vectors for FSDP."""
    return {k: v.reshape(()) if k.rsplit(".", 1)[-1] in LOGIT_KEYS and v.numel() == 1 else v
            for k, v in state_dict.items()}


def fit_logits(state_dict: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with the logit scale and bias shaped like ``module``'s (0-dim or 1-element)."""
    own = dict(module.named_parameters())
    return {k: v.reshape(own[k].shape) if k.rsplit(".", 1)[-1] in LOGIT_KEYS and k in own and v.numel() == 1 else v
            for k, v in state_dict.items()}


def make_tokenizer(model_cfg: dict):
    text_cfg = model_cfg.get("text_cfg", {})
    ctx = text_cfg.get("context_length", CONTEXT_LENGTH)
    if text_cfg.get("hf_tokenizer_name"):
        return open_clip.tokenizer.HFTokenizer(text_cfg["hf_tokenizer_name"], context_length=ctx)
    return open_clip.tokenizer.SimpleTokenizer(context_length=ctx)


class DualEncoder(nn.Module):
    """The trained module: an open_clip model plus the precomputed-text shortcut.

    ``forward`` returns named, normalised features. With ``text_from_targets`` (a locked,
    mean-pooled HF text tower that is also the target encoder) text features are
    ``normalize(proj(t))`` for the stored target embedding ``t``: because the projection is linear
    without bias and ``t`` is the normalised mean-pooled output of the same frozen transformer, this
    equals ``encode_text(tokens)`` exactly, without running the transformer.
    """

    def __init__(self, clip: nn.Module, text_from_targets: bool = False, lock_text: bool = False,
                 max_logit_scale: float | None = None):
        super().__init__()
        self.clip = clip
        self.text_from_targets = text_from_targets
        self.lock_text = lock_text
        # the trainer also clamps the parameter after each step (as open_clip_train does); the
        # clamp here holds where that one cannot reach the weights the optimizer keeps (DeepSpeed's
        # fp32 master copy): a no-op for a scale within bounds, and the same gradient there
        self.max_log_scale = math.log(max_logit_scale) if max_logit_scale else None
        self.ssl: SelfSupervised | None = None  # the self-supervised terms' heads (set by the trainer)

    def train(self, mode: bool = True) -> DualEncoder:
        super().train(mode)
        if self.lock_text:
            self.clip.text.eval()  # a locked tower runs deterministically (no dropout), as in LiT
        return self

    def forward(
        self,
        images: torch.Tensor,
        tokens: torch.Tensor | None = None,
        target_embeddings: torch.Tensor | None = None,
        negative_tokens: torch.Tensor | None = None,
        encodings: bool = False,
        patch_keep: torch.Tensor | None = None,
        caption: bool = False,
        ssl: SslInputs | None = None,
    ) -> dict[str, torch.Tensor]:
        """``images (B, 3, H, W)``, ``tokens (B, L)``, ``target_embeddings (B, E)``; ``negative_tokens (B, L)``
        (hard negatives) are encoded in the same text pass and returned as ``negative_text_features``;
        ``encodings``: also ``image_encodings``, the image tower's pooled output before its projection
        (detached: targets are made of it, never trained through it); ``patch_keep (B, K)``: the patches the
        image tower keeps (``model.patch_dropout``, :mod:`mmpretrain.models.patch_dropout`; None: all);
        ``caption``: also the caption decoder's next-token ``caption_logits (B, L-1, V)`` over the image
        tower's tokens, teacher-forced on ``tokens``, and their targets ``caption_labels = tokens[:, 1:]``
        (a CoCa model: :func:`caption_outputs`); ``ssl``: the student's outputs of ``self_distill`` /
        ``masked_prediction`` too (:mod:`mmpretrain.models.ssl`; ``self.ssl`` holds their heads)."""
        out = self._features(images, tokens, target_embeddings, negative_tokens, encodings, patch_keep, caption)
        if ssl is not None:
            out.update(student_outputs(self.clip.visual, self.ssl, images, ssl))
        if self.ssl is not None and self.training:  # every head in the graph, at any step (SelfSupervised.zero)
            out["image_features"] = out["image_features"] + self.ssl.zero()
        return out

    def _features(self, images, tokens, target_embeddings, negative_tokens, encodings, patch_keep, caption):
        if caption:
            with patch_dropout.dropping(self.clip.visual, patch_keep):
                return self._logits(caption_outputs(self.clip, images, tokens))
        enc = None
        with patch_dropout.dropping(self.clip.visual, patch_keep):
            if encodings:
                pooled = pre_projection(self.clip.visual, images)
                enc = pooled.detach()
                image_features = F.normalize(pooled @ self.clip.visual.proj, dim=-1)
            else:
                image_features = self.clip.encode_image(images, normalize=True)
        negative = None
        if self.text_from_targets:
            text_features = F.normalize(self.clip.text.proj(target_embeddings.to(image_features.dtype)), dim=-1)
        elif negative_tokens is not None:
            both = encode_text_trimmed(self.clip, torch.cat([tokens, negative_tokens]))
            text_features, negative = both[:tokens.shape[0]], both[tokens.shape[0]:]
        else:
            text_features = encode_text_trimmed(self.clip, tokens)
        return self._logits({
            "image_features": image_features,
            "text_features": text_features,
            **({"negative_text_features": negative} if negative is not None else {}),
            **({"image_encodings": enc} if enc is not None else {}),
        })

    def _logits(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``features`` with the logit scale (clamped, exponentiated) and bias, both 0-dim also when built
        as vectors for FSDP."""
        scale, bias = self.clip.logit_scale, self.clip.logit_bias
        if self.max_log_scale is not None:
            scale = scale.clamp(0, self.max_log_scale)
        return {**features, "logit_scale": scale.exp().reshape(()),
                "logit_bias": bias.reshape(()) if bias is not None else None}



def has_pre_projection(visual: nn.Module) -> bool:
    """Whether the image tower's output before its projection can be taken (open_clip's ViT: ``proj``)."""
    return isinstance(getattr(visual, "proj", None), torch.Tensor)


def pre_projection(visual: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """open_clip ViT's pooled output before ``proj`` (``visual(x) == pre_projection(visual, x) @ proj``)."""
    proj = visual.proj
    try:
        visual.proj = None
        return visual(images)
    finally:
        visual.proj = proj


def check_text_from_targets(model_cfg: dict, targets_model: str) -> None:
    """Raise ValueError unless ``proj(target embedding)`` equals the text tower's output."""
    text_cfg = model_cfg.get("text_cfg", {})
    problems = []
    if not is_hf_text(model_cfg):
        problems.append("the arch has no Hugging Face text tower")
    else:
        if text_cfg.get("hf_pooler_type") != "mean_pooler":
            problems.append("text_cfg.hf_pooler_type must be mean_pooler (as sentence-transformers pools)")
        if text_cfg.get("hf_proj_type") != "linear":
            problems.append("text_cfg.hf_proj_type must be linear (bias-free, so normalisation commutes)")
        if text_cfg.get("hf_model_name") != targets_model:
            problems.append(
                f"the text tower ({text_cfg.get('hf_model_name')}) must be the target encoder ({targets_model})"
            )
    if problems:
        raise ValueError("model.text_from_targets=true is not exact here: " + "; ".join(problems))


def with_logit_init(model_cfg: dict, scale: float | None, bias: float | None) -> dict:
    """The config with the objective's initial logit scale and bias; a bias makes the model own a
    ``logit_bias`` parameter, so the saved config must carry it for the weights to load back."""
    model_cfg = copy.deepcopy(model_cfg)
    if scale is not None:
        model_cfg["init_logit_scale"] = scale
    if bias is not None:
        model_cfg["init_logit_bias"] = bias
    return model_cfg


def _load_pretrained(clip: nn.Module, pretrained: str, arch: str | None) -> None:
    """``model.pretrained``: an open_clip tag of ``arch``, a weights file, ``hf-hub:ORG/NAME`` (an open_clip
    Hub repo), an export folder, or one of our checkpoints (``run/checkpoints/step_N``, or a run folder:
    its latest). Weights only from safetensors or ``torch.load(weights_only=True)``."""
    p = Path(pretrained)
    if pretrained.startswith("hf-hub:"):
        p = Path(hf_hub_download(pretrained[len("hf-hub:"):], "open_clip_model.safetensors"))
    if p.is_dir():
        ckpt = RunFolder(p).latest_checkpoint() or p
        if (ckpt / MODEL_WEIGHTS).is_file():  # accelerate's save_state of our DualEncoder
            sd = checkpoint_clip_weights(ckpt)
        elif (ckpt / "open_clip_model.safetensors").is_file():
            sd = load_file(ckpt / "open_clip_model.safetensors")
        else:
            raise ValueError(f"model.pretrained={pretrained}: no {MODEL_WEIGHTS} (checkpoint) or "
                             "open_clip_model.safetensors (export) in it")
        missing, unexpected = clip.load_state_dict(fit_logits(sd, clip), strict=False)
        if unexpected or [m for m in missing if not m.startswith("text.transformer.")]:
            raise ValueError(f"model.pretrained={pretrained}: weights do not fit model.arch (missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]})")
        return
    if p.is_file():
        if p.suffix == ".safetensors":
            clip.load_state_dict(fit_logits(load_file(p), clip), strict=False)
            return
        try:
            open_clip.load_checkpoint(clip, str(p), strict=False, weights_only=True)
        except UnpicklingError:
            raise ValueError(f"model.pretrained={pretrained}: the file holds pickled objects other than weights, "
                             "refused for safety (torch.load weights_only). Accepted: a .safetensors file, a "
                             "weights-only torch file, a run or export folder, an open_clip pretrained tag, or "
                             "hf-hub:ORG/NAME") from None
        return
    register_packaged_configs()
    tag_cfg = open_clip.get_pretrained_cfg(arch, pretrained)
    if not tag_cfg:
        raise ValueError(f"model.pretrained={pretrained!r} is neither a file, a folder, hf-hub:ID nor a tag of {arch!r}")
    open_clip.load_checkpoint(clip, open_clip.download_pretrained(tag_cfg), strict=False, weights_only=True)


def build_dual_encoder(
    model_cfg: dict,
    *,
    pretrained: str | None = None,
    arch: str | None = None,
    lock_text: bool = False,
    text_from_targets: bool = False,
    init_logit_scale: float | None = None,
    init_logit_bias: float | None = None,
    lock_text_unlocked_layers: int = 0,
    lock_image: bool = False,
    lock_image_unlocked_groups: int = 0,
    grad_checkpointing: bool = False,
    nonscalar_logit_scale: bool = False,
    max_logit_scale: float | None = None,
    patch_dropout_prob: float = 0.0,
) -> DualEncoder:
    """The model to train. ``init_logit_*`` come from the objective's declared preferences;
    ``nonscalar_logit_scale`` for FSDP (:func:`instantiate`); ``max_logit_scale``: the forward uses
    the scale clamped to ``[1, max]``; ``patch_dropout_prob`` > 0: the seeded patch-dropout slot installed."""
    model_cfg = with_logit_init(model_cfg, init_logit_scale, init_logit_bias)
    clip = instantiate(model_cfg, load_text_weights=pretrained is None, nonscalar_logit_scale=nonscalar_logit_scale)
    if pretrained is not None:
        _load_pretrained(clip, pretrained, arch)
    if lock_text:
        clip.lock_text_tower(unlocked_layers=lock_text_unlocked_layers, freeze_layer_norm=True)
    if lock_image:  # open_clip's LiT locking: BatchNorm statistics frozen too
        clip.lock_image_tower(unlocked_groups=lock_image_unlocked_groups, freeze_bn_stats=True)
    if grad_checkpointing:
        clip.set_grad_checkpointing(True)
    if patch_dropout_prob > 0:
        patch_dropout.install(clip.visual, arch)
    return DualEncoder(clip, text_from_targets=text_from_targets, lock_text=lock_text and not lock_text_unlocked_layers,
                       max_logit_scale=max_logit_scale)
