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

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import yaml

from mmpretrain.models.factory import latest_checkpoint, load_run_clip

COPIED = ("config.yaml", "provenance.json", "results.json")


class ExportError(ValueError):
    pass


def _card(run_dir: Path, model_cfg: dict, repo_id: str | None, fmt: str = "open_clip", towers: str = "both") -> str:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    prov = json.loads((run_dir / "provenance.json").read_text()) if (run_dir / "provenance.json").is_file() else {}
    results = json.loads((run_dir / "results.json").read_text()) if (run_dir / "results.json").is_file() else {}
    front = {
        "library_name": fmt,
        "pipeline_tag": "zero-shot-image-classification" if towers == "both" else "image-feature-extraction",
        # weights trained on share-alike data (the OpenMoji demo) carry its licence; otherwise the code's
        "license": "cc-by-sa-4.0" if "openmoji" in json.dumps(cfg) else "apache-2.0",
        "tags": ["clip", "open_clip", "mmpretrain", "contrastive-learning"],
    }
    datasets = sorted({r["dataset"] for r in results.get("results", [])})
    if datasets:
        front["datasets"] = datasets
    name = repo_id or cfg.get("name", run_dir.name)
    resolved = cfg.get("resolved", {})
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {name}", "",
             "Image-text dual encoder trained with mmpretrain (distribution `simpretrain`).", "",
             "## Training", "",
             f"- architecture: `{cfg.get('model', {}).get('arch')}` (full config in `open_clip_config.json`)",
             f"- image tower: {model_cfg['vision_cfg'].get('image_size')} px, "
             f"text tower: `{model_cfg['text_cfg'].get('hf_model_name', 'open_clip transformer')}`"
             + (" (locked)" if cfg.get("model", {}).get("lock_text") else ""),
             "- objective: " + " + ".join(f"{t['weight']} x {t['name']}" for t in cfg.get("loss", [])),
             f"- data: `{cfg.get('data', {}).get('train')}`, {resolved.get('total_steps')} steps at global batch "
             f"{resolved.get('global_batch_size')} on {resolved.get('world_size')} process(es)",
             f"- code: git `{prov.get('git_sha')}`; packages: "
             + ", ".join(f"{k} {v}" for k, v in (prov.get("packages") or {}).items() if v), ""]
    if results.get("results"):
        lines += ["## Evaluation", "", "| dataset | task | metric | value | chance |", "|---|---|---|---|---|"]
        for r in results["results"]:
            for k, v in r["metrics"].items():
                lines.append(f"| {r['dataset']} | {r['task']} | {k} | {v:.4f} | {r.get('chance', {}).get(k, float('nan')):.4f} |")
        lines.append("")
    if (run_dir / "plots").is_dir():
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in sorted((run_dir / "plots").glob("*.png"))]
        lines.append("")
    repo = repo_id or "ORG/NAME"
    if fmt == "transformers" and towers == "image":
        use = ["from transformers import CLIPVisionModelWithProjection, CLIPImageProcessor",
               f"model = CLIPVisionModelWithProjection.from_pretrained('{repo}')",
               f"processor = CLIPImageProcessor.from_pretrained('{repo}')"]
    elif fmt == "transformers":
        use = ["from transformers import CLIPModel, CLIPProcessor", f"model = CLIPModel.from_pretrained('{repo}')",
               f"processor = CLIPProcessor.from_pretrained('{repo}')"]
    else:
        use = ["import open_clip", f"model, preprocess = open_clip.create_model_from_pretrained('hf-hub:{repo}')",
               f"tokenizer = open_clip.get_tokenizer('hf-hub:{repo}')"]
    lines += ["## Use", "", "```python", *use, "```", ""]
    if "openmoji" in json.dumps(cfg):
        lines += ["Trained on emoji by OpenMoji, the open-source emoji and icon project (CC BY-SA 4.0).", ""]
    return "\n".join(lines)


def export(run_dir: str | Path, out: str | Path, *, fmt: str = "open_clip", towers: str = "both",
           repo_id: str | None = None) -> list[Path]:
    from safetensors.torch import save_file

    run_dir, out = Path(run_dir), Path(out)
    if fmt == "open_clip" and towers != "both":
        raise ExportError("--towers image needs --format transformers (open_clip loads only whole models); "
                          "it writes a CLIPVisionModelWithProjection")
    if latest_checkpoint(run_dir) is None:
        raise ExportError(f"{run_dir} has no complete checkpoint (checkpoints/step_*/train_state.json)")
    clip, model_cfg, preprocess_cfg = load_run_clip(run_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if fmt == "transformers":
        from mmpretrain.export_hf import Unsupported, save_transformers

        try:
            save_transformers(clip, model_cfg, preprocess_cfg, tmp, towers)
        except Unsupported as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ExportError(str(e)) from None
    else:
        (tmp / "open_clip_config.json").write_text(
            json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, indent=2))
        save_file({k: v.contiguous() for k, v in clip.state_dict().items()},
                  str(tmp / "open_clip_model.safetensors"), metadata={"format": "pt"})
        tok_name = model_cfg.get("text_cfg", {}).get("hf_tokenizer_name")
        if tok_name:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tok_name).save_pretrained(str(tmp))
    for name in COPIED:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, tmp / name)
    if (run_dir / "plots").is_dir():
        shutil.copytree(run_dir / "plots", tmp / "plots")
    (tmp / "README.md").write_text(_card(run_dir, model_cfg, repo_id, fmt, towers))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return sorted(p for p in out.rglob("*") if p.is_file())


def push(folder: Path, repo_id: str, *, private: bool, revision: str | None) -> str:
    """Upload through huggingface_hub; the token comes from HF_TOKEN or the saved login, never printed."""
    from huggingface_hub import create_repo, upload_folder

    create_repo(repo_id, private=private, exist_ok=True)
    info = upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision,
                         commit_message="Upload mmpretrain export")
    return str(getattr(info, "commit_url", info))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmpretrain.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run folder (its latest complete checkpoint is exported)")
    p.add_argument("--out", required=True, help="export folder to write")
    p.add_argument("--format", default="open_clip", choices=["open_clip", "transformers"],
                   help="transformers: CLIPModel + CLIPProcessor (ViT image tower, open_clip text transformer)")
    p.add_argument("--towers", default="both", choices=["both", "image"],
                   help="image: the image encoder alone (with --format transformers)")
    p.add_argument("--push-to-hub", default=None, metavar="ORG/NAME", help="upload the folder to this Hub repo")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", default=None)
    p.add_argument("--dry-run", action="store_true", help="with --push-to-hub: list what would be uploaded")
    args = p.parse_args(argv)
    try:
        files = export(args.run_dir, args.out, fmt=args.format, towers=args.towers, repo_id=args.push_to_hub)
    except (ExportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    for f in files:
        print(f"{f.relative_to(out)}\t{f.stat().st_size}")
    if args.push_to_hub:
        if args.dry_run:
            print(f"dry run: would upload {len(files)} files to {args.push_to_hub}")
        else:
            print(f"pushed: {push(out, args.push_to_hub, private=args.private, revision=args.revision)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
