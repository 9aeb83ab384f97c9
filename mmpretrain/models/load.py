"""Trained models back from disk for evaluation and export: a run folder's latest checkpoint, an export
folder (``local-dir:`` too), an open_clip Hub repo (``hf-hub:``), or an open_clip architecture with a
pretrained tag."""

from __future__ import annotations

from pathlib import Path

import open_clip
from open_clip.transform import PreprocessCfg, image_transform_v2
from torch import nn

from mmpretrain.models.factory import instantiate, make_tokenizer, register_packaged_configs
from mmpretrain.run_files import RunFolder, checkpoint_clip_weights


def load_run_clip(run_dir: str | Path, device: str = "cpu") -> tuple[nn.Module, dict, dict]:
    """The open_clip model of a run's latest checkpoint, with its model and preprocess configs."""
    files = RunFolder(Path(run_dir))
    ckpt = files.latest_checkpoint()
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint under checkpoints/step_*/")
    model_cfg, preprocess_cfg = files.read_model_config()
    clip = instantiate(model_cfg, load_text_weights=False)
    clip.load_state_dict(checkpoint_clip_weights(ckpt), strict=True)
    return clip.to(device).eval(), model_cfg, preprocess_cfg


def load_model(path: str, device: str = "cpu", pretrained: str | None = None):
    """``(model, preprocess, tokenizer)`` from a run folder, an export folder (``local-dir:`` too),
    ``hf-hub:ID``, or an open_clip architecture name with ``pretrained``."""
    register_packaged_configs()
    spec = str(path)
    if spec.startswith("hf-hub:"):
        model, preprocess = open_clip.create_model_from_pretrained(spec, device=device)
        return model.eval(), preprocess, open_clip.get_tokenizer(spec)
    folder = Path(spec.removeprefix("local-dir:"))
    if (folder / "open_clip_config.json").is_file():
        ref = "local-dir:" + str(folder)
        model, preprocess = open_clip.create_model_from_pretrained(ref, device=device)
        return model.eval(), preprocess, open_clip.get_tokenizer(ref)
    if RunFolder(folder).is_run():
        clip, model_cfg, preprocess_cfg = load_run_clip(folder, device)
        preprocess = image_transform_v2(PreprocessCfg(**preprocess_cfg), is_train=False)
        return clip, preprocess, make_tokenizer(model_cfg)
    if spec.startswith("local-dir:") or folder.exists():
        raise FileNotFoundError(
            f"{folder} is neither a run folder (model_config.json + checkpoints/) nor an export folder "
            "(open_clip_config.json)"
        )
    if spec in open_clip.list_models():
        model, _, preprocess = open_clip.create_model_and_transforms(spec, pretrained=pretrained, device=device)
        return model.eval(), preprocess, open_clip.get_tokenizer(spec)
    raise ValueError(
        f"--model {spec!r}: not a folder, not hf-hub:ID, and not an open_clip architecture "
        "(see open_clip.list_models())"
    )
