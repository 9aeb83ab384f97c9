"""The export's model card (``README.md``): what was trained on which data, under which licence (the
training data's, as the run recorded it from their manifests), how to load it, and its results."""

from __future__ import annotations

import yaml

from mmpretrain.run_files import RunFolder

# Hub licence identifiers of the licences data_tools records in manifests
HUB_LICENSES = {"CC BY-SA 4.0": "cc-by-sa-4.0", "CC BY 4.0": "cc-by-4.0", "CC0 1.0": "cc0-1.0",
                "CC BY-NC 4.0": "cc-by-nc-4.0", "CC BY-NC-SA 4.0": "cc-by-nc-sa-4.0", "Apache-2.0": "apache-2.0",
                "MIT": "mit"}
CODE_LICENSE = "apache-2.0"


def training_data(files: RunFolder) -> list[dict]:
    """The training sources as the run recorded them from their manifests (provenance.json ``data``)."""
    return files.read_json(files.provenance).get("data") or []


def license_for(data: list[dict]) -> str:
    """Weights trained on data under a recorded licence carry it (share-alike data: the OpenMoji demo);
    several different ones: ``other`` (the card lists them); none recorded: the code's."""
    names = sorted({d["license"] for d in data if d.get("license")})
    if not names:
        return CODE_LICENSE
    if len(names) == 1:
        return HUB_LICENSES.get(names[0], "other")
    return "other"


def model_card(files: RunFolder, model_cfg: dict, repo_id: str | None, fmt: str = "open_clip", towers: str = "both",
               wise: dict | None = None) -> str:
    cfg = yaml.safe_load(files.config.read_text()) if files.config.is_file() else {}
    prov = files.read_json(files.provenance)
    results = files.read_json(files.results)
    data = training_data(files)
    front = {
        "library_name": fmt,
        "pipeline_tag": "zero-shot-image-classification" if towers == "both" else "image-feature-extraction",
        "license": license_for(data),
        "tags": ["clip", "open_clip", "mmpretrain", "contrastive-learning"],
    }
    datasets = sorted({d["dataset"] for d in data if d.get("dataset")})
    if datasets:
        front["datasets"] = datasets
    name = repo_id or cfg.get("name", files.root.name)
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
    model = cfg.get("model", {})
    if model.get("pretrained"):
        lora = model.get("lora")
        how = (f"LoRA (rank {lora['rank']}, alpha {lora['alpha']:g}, {'+'.join(lora['modules'])} of the "
               f"{'+'.join(lora['towers'])} tower(s)), merged into these weights" if lora else "full fine-tuning"
               + (" of the unlocked towers" if model.get("lock_image") or model.get("lock_text") else ""))
        decay = (cfg.get("optim") or {}).get("layer_decay")
        lines.insert(-1, f"- fine-tuned from: `{model['pretrained']}` by {how}"
                     + (f", layer-wise learning-rate decay {decay}" if decay else ""))
    if wise is not None and wise.get("ema"):
        e = cfg.get("train", {}).get("ema") or {}
        lines += ["## Weights", "", f"The exponential moving average of the trained weights (train.ema: decay "
                  f"{e.get('decay')}, every {e.get('every')} step(s), a copy until step {e.get('warmup_steps')}), "
                  "not the last step's weights.", ""]
    if wise is not None and "method" in wise:
        lines += ["## Weight interpolation (WiSE-FT)", "",
                  f"These weights are `(1 - {wise['alpha']}) x {wise['pretrained']} + {wise['alpha']} x` the "
                  "fine-tuned run's, per tensor (Wortsman et al., CVPR 2022); the results below are the "
                  "fine-tuned run's, not this interpolation's.", ""]
    if data:
        lines += ["## Training data", "", "| source | dataset | licence | samples |", "|---|---|---|---|"]
        lines += [f"| `{d.get('spec')}` | {d.get('dataset') or '-'} | {d.get('license') or 'not recorded'} | "
                  f"{d.get('samples', '-')} |" for d in data]
        lines.append("")
    if results.get("results"):
        lines += ["## Evaluation", "", "| dataset | task | metric | value | chance |", "|---|---|---|---|---|"]
        for r in results["results"]:
            for k, v in r["metrics"].items():
                lines.append(f"| {r['dataset']} | {r['task']} | {k} | {v:.4f} | {r.get('chance', {}).get(k, float('nan')):.4f} |")
        lines.append("")
    if files.plots.is_dir():
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in sorted(files.plots.glob("*.png"))]
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
    for d in data:  # credit as the data's licence asks (e.g. OpenMoji, CC BY-SA 4.0)
        if d.get("attribution"):
            lines += [f"Training data: {d['attribution']}", ""]
    seen = {d.get("attribution") for d in data}
    for r in results.get("results") or []:  # evaluation sets credited as their manifests ask (e.g. Noto, Apache-2.0)
        credit = r.get("data") or {}
        if credit.get("attribution") and credit["attribution"] not in seen:
            seen.add(credit["attribution"])
            lines += [f"Evaluation data ({r['dataset']}, {credit.get('license', 'licence not recorded')}): "
                      f"{credit['attribution']}", ""]
    return "\n".join(lines)
