"""WiSE-FT (Wortsman et al., CVPR 2022): the fine-tuned weights interpolated with the ones the fine-tune
started from, ``(1 - alpha) x pretrained + alpha x fine-tuned`` for every floating tensor. ``alpha = 0``
is the pretrained model and ``alpha = 1`` the fine-tuned one, exactly; between them the interpolation
keeps much of the zero-shot robustness a fine-tune loses. Both models must be the same architecture
(the same tensor names and shapes); anything else is refused, naming the first differences."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["WiseFTError", "interpolate", "pretrained_for", "pretrained_state"]


class WiseFTError(ValueError):
    pass


def pretrained_for(model: str, spec: str) -> tuple[str, str | None]:
    """(the weights to interpolate with, the architecture for an open_clip tag): ``spec == "run"`` is the
    run folder's own ``model.pretrained``."""
    import yaml

    cfg_file = Path(model.removeprefix("local-dir:")) / "config.yaml"
    cfg = yaml.safe_load(cfg_file.read_text()) if cfg_file.is_file() else {}
    m = (cfg or {}).get("model") or {}
    if spec == "run":
        if not m.get("pretrained"):
            raise WiseFTError(f"--interpolate: {model} was trained from scratch or is not a run folder (its "
                              "config.yaml has no model.pretrained); give the weights: --interpolate PRETRAINED")
        spec = m["pretrained"]
    return spec, m.get("arch")


def pretrained_state(spec: str, arch: str | None) -> dict[str, torch.Tensor]:
    """The weights ``spec`` names, as ``model.pretrained`` accepts them: a run folder or checkpoint, an
    export folder, a ``.safetensors`` or weights-only torch file, ``hf-hub:ORG/NAME``, or an open_clip
    tag of ``arch``. Weights only (safetensors, ``torch.load(weights_only=True)``)."""
    import open_clip
    from safetensors.torch import load_file

    from mmpretrain.models.factory import register_packaged_configs
    from mmpretrain.run_files import MODEL_WEIGHTS, RunFolder, checkpoint_clip_weights

    p = Path(spec)
    if spec.startswith("hf-hub:"):
        from huggingface_hub import hf_hub_download

        p = Path(hf_hub_download(spec[len("hf-hub:"):], "open_clip_model.safetensors"))
    if p.is_dir():
        ckpt = RunFolder(p).latest_checkpoint() or p
        if (ckpt / MODEL_WEIGHTS).is_file():
            return checkpoint_clip_weights(ckpt)
        if (ckpt / "open_clip_model.safetensors").is_file():
            return load_file(ckpt / "open_clip_model.safetensors")
        raise WiseFTError(f"--interpolate {spec}: a folder without {MODEL_WEIGHTS} (a run or checkpoint) or "
                          "open_clip_model.safetensors (an export)")
    if p.is_file():
        if p.suffix == ".safetensors":
            return load_file(p)
        try:
            return open_clip.load_state_dict(str(p), weights_only=True)
        except Exception as e:  # an unpickling refusal or a damaged file
            raise WiseFTError(f"--interpolate {spec}: not a weights file ({type(e).__name__}); give a .safetensors "
                              "file, a weights-only torch file, a run or export folder, hf-hub:ORG/NAME or an "
                              "open_clip tag") from None
    register_packaged_configs()
    tag = open_clip.get_pretrained_cfg(arch, spec) if arch else None
    if not tag:
        raise WiseFTError(f"--interpolate {spec}: neither a file, a folder, hf-hub:ID nor an open_clip tag of "
                          f"{arch!r}")
    return open_clip.load_state_dict(open_clip.download_pretrained(tag), weights_only=True)


def interpolate(finetuned: dict[str, torch.Tensor], pretrained: dict[str, torch.Tensor], alpha: float,
                what: str = "PRETRAINED") -> dict[str, torch.Tensor]:
    """``(1 - alpha) x pretrained + alpha x finetuned`` per floating tensor (computed in float64, stored in
    the fine-tuned dtype; the endpoints are the inputs themselves); other tensors must be equal."""
    if not 0.0 <= alpha <= 1.0:
        raise WiseFTError(f"--alpha {alpha} is outside [0, 1]: 0 is {what}, 1 the fine-tuned run")
    pre = {k.removeprefix("module."): v for k, v in pretrained.items()}
    missing, extra = sorted(set(finetuned) - set(pre)), sorted(set(pre) - set(finetuned))
    shapes = [k for k in finetuned if k in pre and pre[k].numel() != finetuned[k].numel()]
    if missing or extra or shapes:
        parts = [f"{len(missing)} of the run's tensors missing (e.g. {missing[:2]})" if missing else "",
                 f"{len(extra)} not in the run (e.g. {extra[:2]})" if extra else "",
                 f"{len(shapes)} of other shapes (e.g. {shapes[0]}: {tuple(pre[shapes[0]].shape)} vs "
                 f"{tuple(finetuned[shapes[0]].shape)})" if shapes else ""]
        raise WiseFTError(f"--interpolate {what} is not the run's architecture: " + "; ".join(p for p in parts if p)
                          + ". Interpolate with the weights the fine-tune started from (its model.pretrained)")
    out = {}
    for k, ft in finetuned.items():
        p = pre[k].reshape(ft.shape).to(ft.device)
        if not ft.is_floating_point():
            if not torch.equal(p.to(ft.dtype), ft):
                raise WiseFTError(f"--interpolate {what}: {k} (not a weight) differs from the run's")
            out[k] = ft
        elif alpha == 0.0:
            out[k] = p.to(ft.dtype)
        elif alpha == 1.0:
            out[k] = ft
        else:
            out[k] = ((1 - alpha) * p.double() + alpha * ft.double()).to(ft.dtype)
    return out
