"""``python -m mmpretrain.export RUN_DIR --out DIR``: the run's latest checkpoint in open_clip's Hub layout.

``--format transformers`` writes ``transformers.CLIPModel`` + ``CLIPProcessor`` instead (ViT image towers
with open_clip's text transformer; ``--towers image``: ``CLIPVisionModelWithProjection`` alone).
``open_clip_config.json`` holds the architecture actually trained (overrides included) and its
preprocessing; ``open_clip_model.safetensors`` the weights; HF text towers get their tokenizer files
(open_clip's ``local-dir:`` loads the tokenizer from the folder) and keep naming their Hub ID, so
the text tower's config resolves from the Hugging Face cache offline or from the Hub online. Also
written: the run's resolved ``config.yaml``, ``provenance.json``, ``results.json`` and plots, and a
model card ``README.md``. Loads back with ``open_clip.create_model_from_pretrained('local-dir:DIR')``
or ``mmpretrain.load(DIR)``. Exit codes: 0 ok, 1 failed, 2 bad arguments.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from mmpretrain.export.card import model_card
from mmpretrain.run_files import RunFolder

# open_clip, transformers and the Hub client are imported where the export uses them (~7 s on 2 cores):
# `--help` and the refusals of a bad --out answer at once

COPIED = ("config.yaml", "provenance.json", "results.json")

class ExportError(ValueError):
    pass


EXPORT_MANIFEST = "export_manifest.json"  # the files an export wrote: the only ones a later --overwrite replaces


def check_out(run: Path, out: Path, overwrite: bool) -> list[str]:
    """Refuse an ``--out`` that would put the run (or a user's files) at risk; returns the files a
    previous export of this folder wrote (its manifest), which ``--overwrite`` may replace."""
    run_abs, out_abs = run.resolve(), out.resolve()
    if out_abs == run_abs or out_abs in run_abs.parents:
        raise ExportError(f"--out {out} is {'the run folder' if out_abs == run_abs else 'above the run folder'} "
                          f"{run}: the export would mix with (or replace) the run's files. Choose a folder outside "
                          f"it, or inside it such as {run / 'export'}")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a folder: choose a new folder")
    if not out.is_dir() or not any(out.iterdir()):
        return []
    manifest = out / EXPORT_MANIFEST
    previous = json.loads(manifest.read_text()).get("files", []) if manifest.is_file() else []
    if not overwrite:
        what = "an earlier export" if previous else "files this command did not write"
        raise ExportError(f"--out {out} is not empty (it holds {what}); pass --overwrite to replace an earlier "
                          "export (only the files its export_manifest.json lists), or choose an empty folder")
    return previous


def _write_into(tmp: Path, out: Path, previous: list[str]) -> list[str]:
    """Move the export in ``tmp`` into ``out``: replace only files ``previous`` (our manifest) lists, refuse
    to overwrite any other file, delete previous files this export no longer writes."""
    new = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    clash = [f for f in new if (out / f).exists() and f not in previous]
    if clash:
        raise ExportError(f"--out {out} holds {clash[0]} ({len(clash)} file(s)) that no earlier export wrote: "
                          "the export would replace it. Move it away or choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    for f in previous:
        if f not in new and (out / f).is_file():
            (out / f).unlink()
    for f in new:
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / f, out / f)
    files = [*new, EXPORT_MANIFEST]
    (out / EXPORT_MANIFEST).write_text(json.dumps({"files": files, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                         time.gmtime())}, indent=2))
    return files


def export(run_dir: str | Path, out: str | Path, *, fmt: str = "open_clip", towers: str = "both",
           repo_id: str | None = None, overwrite: bool = False, interpolate: str | None = None,
           alpha: float = 1.0, ema: bool = False) -> list[Path]:
    """Write the export into ``out`` (see :func:`check_out` for what is refused); returns its files.
    ``interpolate``: WiSE-FT with these weights at ``alpha`` (:mod:`mmpretrain.export.wise_ft`; ``"run"``:
    the run's own ``model.pretrained``)."""
    files, out = RunFolder(Path(run_dir)), Path(out)
    if fmt == "open_clip" and towers != "both":
        raise ExportError("--towers image needs --format transformers (open_clip loads only whole models); "
                          "it writes a CLIPVisionModelWithProjection")
    if files.latest_checkpoint() is None:
        raise ExportError(f"{run_dir} has no complete checkpoint (checkpoints/step_*/train_state.json)")
    if not files.model_config.is_file():
        raise ExportError(f"{run_dir} has no model_config.json (the architecture its checkpoints were trained with): "
                          "it is not a run folder `python -m mmpretrain.train` wrote, or the file was removed; put "
                          "the run's model_config.json back")
    previous = check_out(files.root, out, overwrite)
    from mmpretrain.models.from_disk import WeightsError, load_run_clip

    try:
        clip, model_cfg, preprocess_cfg = load_run_clip(files.root, ema=ema)
    except WeightsError as e:
        raise ExportError(f"{files.latest_checkpoint()}: {e}") from None
    except FileNotFoundError as e:
        raise ExportError(f"--ema: {e}; export without --ema, or train with train.ema={{decay: 0.9998}}") from None
    wise = {"ema": True} if ema else None
    if interpolate is not None:
        wise = {**_interpolate(files, clip, interpolate, alpha), **(wise or {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))  # ours alone to delete
    try:
        _write_export(files, tmp, clip, model_cfg, preprocess_cfg, fmt, towers, repo_id, wise)
        written = _write_into(tmp, out, previous)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / f for f in written]


def _interpolate(files: RunFolder, clip, spec: str, alpha: float) -> dict:
    """Load ``spec``'s weights into ``clip`` interpolated with the run's at ``alpha``; what the card says."""
    from mmpretrain.export.wise_ft import WiseFTError, interpolate, pretrained_for, pretrained_state

    try:
        spec, arch = pretrained_for(str(files.root), spec)
        state = interpolate(clip.state_dict(), pretrained_state(spec, arch), alpha, what=spec)
    except (WiseFTError, FileNotFoundError, OSError) as e:
        raise ExportError(str(e)) from None
    clip.load_state_dict(state, strict=True)
    return {"method": "WiSE-FT", "pretrained": spec, "alpha": alpha}


def _write_export(files: RunFolder, tmp: Path, clip, model_cfg: dict, preprocess_cfg: dict, fmt: str, towers: str,
                  repo_id: str | None, wise: dict | None = None) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from mmpretrain.export.hf import Unsupported, save_transformers
    from mmpretrain.export.siglip2 import save_siglip2
    from mmpretrain.models.naflex import is_naflex

    if fmt == "transformers":
        try:
            if is_naflex(model_cfg):
                save_siglip2(clip, model_cfg, {**preprocess_cfg, **_naflex_length(files)}, tmp, towers)
            else:
                save_transformers(clip, model_cfg, preprocess_cfg, tmp, towers)
        except Unsupported as e:
            raise ExportError(str(e)) from None
    else:
        (tmp / "open_clip_config.json").write_text(
            json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, indent=2))
        save_file({k: v.contiguous() for k, v in clip.state_dict().items()},
                  str(tmp / "open_clip_model.safetensors"), metadata={"format": "pt"})
        tok_name = model_cfg.get("text_cfg", {}).get("hf_tokenizer_name")
        if tok_name:
            AutoTokenizer.from_pretrained(tok_name).save_pretrained(str(tmp))
    for name in COPIED:
        if (files.root / name).is_file():
            shutil.copy2(files.root / name, tmp / name)
    if files.plots.is_dir():
        shutil.copytree(files.plots, tmp / "plots")
    (tmp / "README.md").write_text(model_card(files, model_cfg, repo_id, fmt, towers, wise))
    if wise is not None and "method" in wise:
        (tmp / "wise_ft.json").write_text(json.dumps(wise, indent=2))



def _naflex_length(files: RunFolder) -> dict:
    """A NaFlex run's longest training sequence, the exported image processor's default ``max_num_patches``."""
    from mmpretrain.models.from_disk import run_longest_length

    longest = run_longest_length(files.config)
    return {"naflex_seq_len": longest} if longest else {}
