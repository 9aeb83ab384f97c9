"""Trained models back from disk for evaluation and export: a run folder's latest checkpoint, an export
folder (``local-dir:`` too), an open_clip Hub repo (``hf-hub:``), or an open_clip architecture with a
pretrained tag."""

from __future__ import annotations

import contextlib
from pathlib import Path
from pickle import UnpicklingError

import open_clip
from open_clip.transform import PreprocessCfg, image_transform_v2
from safetensors import SafetensorError
from torch import nn

from mmpretrain.models.factory import instantiate, make_tokenizer, register_packaged_configs
from mmpretrain.models.naflex import for_eval, is_naflex_tower
from mmpretrain.run_files import RunFolder, checkpoint_clip_weights


class WeightsError(ValueError):
    """Weights on disk that cannot be loaded."""


@contextlib.contextmanager
def readable_weights():
    """Weights that cannot be loaded -> ValueError saying why and the fix (not naming the path: the caller
    does): a pickle holding more than tensors (never unpickled), a damaged safetensors file."""
    try:
        yield
    except UnpicklingError:
        raise WeightsError("its weights file holds pickled objects other than tensors and was not loaded (unpickling "
                         "them can run code); export the model again (`python -m mmpretrain.export` writes "
                         "safetensors)") from None
    except SafetensorError as e:
        raise WeightsError(f"its weights are not a readable safetensors file ({e}): the file is damaged or cut short; "
                         "export or train it again") from None


def load_run_clip(run_dir: str | Path, device: str = "cpu", ema: bool = False) -> tuple[nn.Module, dict, dict]:
    """The open_clip model of a run's latest checkpoint, with its model and preprocess configs; ``ema``:
    with the checkpoint's weight average (train.ema) in place of the weights it averages. A LoRA run's
    adapters are merged into the weights (the plain architecture)."""
    files = RunFolder(Path(run_dir))
    ckpt = files.latest_checkpoint()
    if ckpt is None:
        raise FileNotFoundError("no complete checkpoint under checkpoints/step_*/")
    model_cfg, preprocess_cfg = files.read_model_config()
    clip = instantiate(model_cfg, load_text_weights=False)
    lora = _lora_of(files)
    with readable_weights():
        state = checkpoint_clip_weights(ckpt)
        if ema:
            from mmpretrain.run_files import EMA_WEIGHTS, checkpoint_ema_weights

            avg = checkpoint_ema_weights(ckpt)
            if avg is None:
                raise FileNotFoundError(f"{ckpt} holds no {EMA_WEIGHTS} (the run trained without train.ema)")
            for name, v in avg.items():
                if not name.startswith("clip."):  # the self-supervised heads (models/ssl.py): not exported
                    continue
                key = name.removeprefix("clip.")
                state[key] = v.reshape(state[key].shape) if key in state else v
        want = getattr(clip.visual, "positional_embedding", None)
        if "visual.positional_embedding" in state and want is not None:
            # train.phases: a boundary's checkpoint is on the previous phase's grid (open_clip's resize rule)
            from mmpretrain.models.positions import fit_positions

            state["visual.positional_embedding"] = fit_positions(state["visual.positional_embedding"], want.shape[0])
        if lora is None:
            clip.load_state_dict(state, strict=True)
        else:  # model.lora: the adapters merged into the weights, the plain architecture back
            from mmpretrain.models.lora import merge_lora

            clip = merge_lora(clip, lora, state)
    return clip.to(device).eval(), model_cfg, preprocess_cfg


def _lora_of(files: RunFolder) -> dict | None:
    """The run's ``model.lora`` settings (its resolved config.yaml), or None."""
    import yaml

    if not files.config.is_file():
        return None
    cfg = yaml.safe_load(files.config.read_text()) or {}
    return (cfg.get("model") or {}).get("lora")


def load_model(path: str, device: str = "cpu", pretrained: str | None = None, naflex_seq_len: int | None = None):
    """``(model, preprocess, tokenizer)`` from a run folder, an export folder (``local-dir:`` too),
    ``hf-hub:ID``, or an open_clip architecture name with ``pretrained``. What cannot be loaded is a
    FileNotFoundError / ValueError saying why and the fix, not naming ``path`` (the caller names it with its
    flag): no such model, damaged weights, a pickle holding more than tensors (never unpickled).
    A NaFlex model comes wrapped (:class:`~mmpretrain.models.naflex.NaFlexInputs`) with its transform at
    ``naflex_seq_len`` patches (default: a run's longest training length, else its position table's)."""
    with readable_weights():
        model, preprocess, tokenizer = _load_model(path, device, pretrained)
    if not is_naflex_tower(model.visual):
        return model, preprocess, tokenizer
    folder = RunFolder(Path(str(path).removeprefix("local-dir:")))
    seq_len = naflex_seq_len or run_longest_length(folder.config)
    norm = preprocess.transforms[-1]  # open_clip's eval transform ends in Normalize(mean, std)
    model, preprocess = for_eval(model, {"mean": tuple(norm.mean), "std": tuple(norm.std)}, seq_len)
    return model, preprocess, tokenizer


def run_longest_length(config: Path) -> int | None:
    """A NaFlex run's longest ``data.naflex.seq_lens``, from its config.yaml (None: not a NaFlex run)."""
    import yaml

    try:
        lens = ((yaml.safe_load(config.read_text()) or {}).get("data", {}).get("naflex") or {}).get("seq_lens")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return max(lens) if isinstance(lens, list) and lens else None


def _load_model(path: str, device: str, pretrained: str | None):
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
        raise FileNotFoundError("neither a run folder (model_config.json + checkpoints/) nor an export folder "
                                "(open_clip_config.json)")
    if spec in open_clip.list_models():
        model, _, preprocess = open_clip.create_model_and_transforms(spec, pretrained=pretrained, device=device)
        return model.eval(), preprocess, open_clip.get_tokenizer(spec)
    raise ValueError("no such folder, not hf-hub:ID, and not an open_clip architecture (see "
                     "open_clip.list_models())")
