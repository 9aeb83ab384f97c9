"""A corpus of malformed configs and overrides, each as a user would write it, with the words the
error must contain (the key, and where it helps the fix). ``test_config_corpus.py`` runs every one
through ``python -m mmpretrain.train``'s entry point: exit 2, that message, no traceback, nothing
trained.

A case is ``(id, yaml, overrides, needle)`` or with a fifth element of options:
``yaml`` is merged into a valid base config (``None`` values delete the key), or a ``{"__file__": ...}``
that says what the config file itself is; ``{tmp}`` and ``{data}`` in strings are replaced by the
case's scratch folder and a real embedded dataset; options: ``env`` (extra environment), ``prepare``
(a callable ``(tmp, data) -> None`` that writes files first).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml


def _base() -> dict[str, Any]:
    return {
        "run_dir": "{tmp}/run",
        "data": {"train": "{data}/train", "batch_size": 16, "num_workers": 0},
        "model": {"arch": "mmpt-tiny-vit-minilm", "lock_text": True, "text_from_targets": True},
        "targets": {"source": "shards"},
        "loss": [{"name": "clip"}],
        "train": {"steps": 2, "log_with": [], "progress": False},
    }


def _copy_shards(tmp: Path, data: Path, sizes: str | None = None, name: str = "shards") -> Path:
    out = tmp / name
    out.mkdir()
    for p in sorted((data / "train").iterdir()):
        if p.suffix == ".tar":
            (out / p.name).symlink_to(p)
    (out / "manifest.json").write_text((data / "train" / "manifest.json").read_text())
    if sizes is not None:
        (out / "sizes.json").write_text(sizes)
    return out


def _sizes(data: Path) -> dict[str, Any]:
    return json.loads((data / "train" / "sizes.json").read_text())


def _prep_sizes(text_of):
    def prepare(tmp: Path, data: Path) -> None:
        _copy_shards(tmp, data, text_of(_sizes(data)))
    return prepare


def _first_key(sizes: dict[str, Any]) -> str:
    return next(iter(sizes))


def _prep_file(name: str, text: str = "notes\n"):
    def prepare(tmp: Path, data: Path) -> None:
        (tmp / name).write_text(text)
    return prepare


def _prep_no_sizes(tmp: Path, data: Path) -> None:
    _copy_shards(tmp, data)


def _prep_empty_dir(tmp: Path, data: Path) -> None:
    (tmp / "empty").mkdir()


def _prep_fake_ckpt(tmp: Path, data: Path) -> None:
    (tmp / "ckpt").mkdir()
    (tmp / "ckpt" / "notes.txt").write_text("not a checkpoint")


S = "{tmp}/shards"

CASES: list[tuple] = [
    # -- the file itself
    ("file_missing", {"__file__": "missing"}, [], "not found"),
    ("file_is_dir", {"__file__": "dir"}, [], "not found"),
    ("file_bad_yaml", {"__file__": "text", "text": "data: {train: [x\n"}, [], "is not valid YAML"),
    ("file_top_list", {"__file__": "text", "text": "- data\n- train\n"}, [], "mapping at the top level"),
    ("file_empty", {"__file__": "text", "text": ""}, [], "data: required key is missing"),
    ("file_binary", {"__file__": "bytes", "bytes": b"\x00\xff\xfe garbage \x89PNG"}, [], "c.yaml"),
    ("file_tabs", {"__file__": "text", "text": "data:\n\ttrain: x\n"}, [], "is not valid YAML"),
    # -- unknown keys
    ("typo_top", {"optimm": {"lr": 1}}, [], "optimm: unknown key"),
    ("typo_data", {}, ["data.batch_sise=3"], "data.batch_sise: unknown key"),
    ("typo_model", {}, ["model.archh=RN50"], "model.archh: unknown key"),
    ("typo_train", {}, ["train.stepz=3"], "train.stepz: unknown key"),
    ("typo_loss_term", {"loss": [{"nme": "clip"}]}, [], "loss.0.nme: unknown key"),
    ("typo_targets", {}, ["targets.modle=x"], "targets.modle: unknown key"),
    ("typo_eval", {"eval": {"evry": 1, "datasets": ["{data}"], "tasks": ["knn"]}}, [], "eval.evry: unknown key"),
    ("typo_hub", {"hub": {"repoid": "a/b"}}, [], "hub.repoid: unknown key"),
    ("typo_optim", {}, ["optim.learning_rate=0.1"], "optim.learning_rate: unknown key"),
    ("section_is_value", {"data": "x"}, [], "data"),
    # -- types and ranges
    ("batch_abc", {}, ["data.batch_size=abc"], "data.batch_size"),
    ("batch_negative", {}, ["data.batch_size=-4"], "data.batch_size"),
    ("batch_zero", {}, ["data.batch_size=0"], "data.batch_size"),
    ("batch_float", {}, ["data.batch_size=1.5"], "data.batch_size"),
    ("batch_bool", {}, ["data.batch_size=true"], "data.batch_size"),
    ("steps_bool", {}, ["train.steps=true"], "train.steps"),
    ("steps_zero", {}, ["train.steps=0"], "train.steps"),
    ("steps_negative", {}, ["train.steps=-3"], "train.steps"),
    ("steps_string", {}, ["train.steps=ten"], "train.steps"),
    ("epochs_zero", {"train": {"epochs": 0, "steps": None}}, [], "train.epochs"),
    ("epochs_string", {"train": {"epochs": "two", "steps": None}}, [], "train.epochs"),
    ("epochs_and_steps", {"train": {"epochs": 1, "steps": 2}}, [], "exactly one of train.epochs and train.steps"),
    ("no_duration", {"train": {"steps": None}}, [], "exactly one of train.epochs and train.steps"),
    ("lr_negative", {}, ["optim.lr=-1"], "optim.lr"),
    ("lr_zero", {}, ["optim.lr=0"], "optim.lr"),
    ("lr_nan", {}, ["optim.lr=.nan"], "optim.lr"),
    ("betas_one", {}, ["optim.betas=[0.9,1.0]"], "optim.betas"),
    ("betas_above", {}, ["optim.betas=[1.2,0.98]"], "optim.betas"),
    ("betas_negative", {}, ["optim.betas=[-0.1,0.98]"], "optim.betas"),
    ("betas_scalar", {}, ["optim.betas=0.9"], "optim.betas"),
    ("betas_one_value", {}, ["optim.betas=[0.9]"], "optim.betas"),
    ("eps_zero", {}, ["optim.eps=0"], "optim.eps"),
    ("weight_decay_negative", {}, ["optim.weight_decay=-0.1"], "optim.weight_decay"),
    ("min_lr_ratio_above", {}, ["optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    ("grad_clip_zero", {}, ["optim.grad_clip_norm=0"], "optim.grad_clip_norm"),
    ("warmup_negative", {}, ["optim.warmup_steps=-1"], "optim.warmup_steps"),
    ("warmup_too_long", {}, ["optim.warmup_steps=2"], "optim.warmup_steps=2 must be below"),
    ("optim_impl", {}, ["optim.implementation=fast"], "optim.implementation"),
    ("precision_fp8", {}, ["train.precision=fp8"], "train.precision"),
    ("precision_fp16_cpu", {}, ["train.precision=fp16"], "train.precision=fp16 needs a GPU"),
    ("log_every_zero", {}, ["train.log_every=0"], "train.log_every"),
    ("save_every_zero", {}, ["train.save_every=0"], "train.save_every"),
    ("max_logit_scale_one", {}, ["train.max_logit_scale=1"], "train.max_logit_scale"),
    ("keep_last_zero", {}, ["train.keep_last=0"], "train.keep_last"),
    ("nonfinite_value", {}, ["train.nonfinite=ignore"], "train.nonfinite"),
    ("micro_batch_not_divisor", {}, ["train.micro_batch_size=12"], "must divide data.batch_size=16"),
    ("micro_batch_mode", {}, ["train.micro_batch_mode=chunks"], "train.micro_batch_mode"),
    ("log_with_typo", {}, ["train.log_with=[tensorbord]"], "train.log_with"),
    ("log_with_string", {}, ["train.log_with=tensorboard"], "train.log_with"),
    ("diagnostics_zero", {}, ["train.diagnostics_every=0"], "train.diagnostics_every"),
    ("diagnostics_word", {}, ["train.diagnostics_every=often"], "train.diagnostics_every: must be a positive number"),
    ("progress_word", {}, ["train.progress=maybe"], "train.progress"),
    ("workers_negative", {}, ["data.num_workers=-1"], "data.num_workers"),
    ("shuffle_negative", {}, ["data.shuffle_buffer=-5"], "data.shuffle_buffer"),
    ("nice_above", {}, ["data.worker_nice=30"], "data.worker_nice"),
    ("max_pixels_zero", {}, ["data.max_pixels=0"], "data.max_pixels"),
    ("data_mode", {}, ["data.mode=sequential"], "data.mode"),
    ("num_samples_epoch_mode", {}, ["data.num_samples=100"], "data.mode=resampled"),
    ("weights_epoch_mode", {}, ["data.weights=[1,2]"], "data.weights need data.mode=resampled"),
    ("weights_negative", {}, ["data.mode=resampled", "data.weights=[-2]"], "data.weights must be positive"),
    ("weights_count", {}, ["data.mode=resampled", "data.weights=[1,2]"], "data.weights"),
    ("seed_word", {}, ["seed=abc"], "seed"),
    ("seed_float", {}, ["seed=1.5"], "seed"),
    ("name_list", {"name": [1, 2]}, [], "name"),
    # -- model
    ("arch_unknown", {}, ["model.arch=ViT-Q/99"], "model.arch"),
    ("overrides_typo", {"model": {"overrides": {"vision_cfg": {"layerz": 2}}}}, [], "model.overrides"),
    ("overrides_type", {"model": {"overrides": {"vision_cfg": {"layers": "four"}}}}, [], "model.overrides"),
    ("overrides_top_typo", {"model": {"overrides": {"embed_dimm": 64}}}, [], "model.overrides"),
    ("overrides_embed_negative", {"model": {"overrides": {"embed_dim": -8}}}, [], "model.overrides"),
    ("overrides_not_mapping", {"model": {"overrides": [1, 2]}}, [], "model.overrides"),
    ("text_model_not_cached", {}, ["model.text_from_targets=false", "model.text_model=nobody/no-such-model"],
     "model.text_model=nobody/no-such-model is not in the local Hugging Face cache"),
    ("text_model_missing_folder", {}, ["model.text_from_targets=false", "model.text_model={tmp}/nothing-here"],
     "no such model folder"),
    ("text_model_on_open_clip_text", {}, ["model.text_from_targets=false", "model.arch=mmpt-tiny-vit",
                                          "model.text_model=sentence-transformers/all-MiniLM-L6-v2"],
     "model.text_model is set but arch"),
    ("pretrained_missing", {}, ["model.pretrained={tmp}/missing.pt"], "model.pretrained"),
    ("unlocked_layers_unlocked", {}, ["model.lock_text=false", "model.text_from_targets=false",
                                      "model.lock_text_unlocked_layers=2"], "needs model.lock_text=true"),
    ("unlocked_groups_unlocked", {}, ["model.lock_image_unlocked_groups=2"], "needs model.lock_image=true"),
    ("text_from_targets_unlocked", {}, ["model.lock_text=false"], "needs model.lock_text=true"),
    ("text_from_targets_unlocked_layers", {}, ["model.lock_text_unlocked_layers=2"], "lock_text_unlocked_layers=0"),
    ("unlocked_layers_negative", {}, ["model.lock_text_unlocked_layers=-1"], "model.lock_text_unlocked_layers"),
    # -- data paths
    ("data_missing", {}, ["data.train={tmp}/nowhere"], "{tmp}/nowhere"),
    ("data_file", {}, ["data.train={tmp}/notes.txt"], "notes.txt", {"prepare": _prep_file("notes.txt")}),
    ("data_glob", {}, ["data.train={tmp}/shards/*.tar"], "brace",
     {"prepare": _prep_sizes(lambda s: json.dumps(s))}),
    ("data_no_sizes", {}, [f"data.train={S}"], "sizes.json", {"prepare": _prep_no_sizes}),
    ("data_empty_dir", {}, ["data.train={tmp}/empty"], "{tmp}/empty", {"prepare": _prep_empty_dir}),
    ("sizes_not_json", {}, [f"data.train={S}"], "sizes.json", {"prepare": _prep_sizes(lambda s: "{oops")}),
    ("sizes_list", {}, [f"data.train={S}"], "sizes.json", {"prepare": _prep_sizes(lambda s: "[1, 2]")}),
    ("sizes_negative", {}, [f"data.train={S}"], "sizes.json",
     {"prepare": _prep_sizes(lambda s: json.dumps({**s, _first_key(s): -5}))}),
    ("sizes_fraction", {}, [f"data.train={S}"], "sizes.json",
     {"prepare": _prep_sizes(lambda s: json.dumps({**s, _first_key(s): 12.5}))}),
    ("sizes_string", {}, [f"data.train={S}"], "sizes.json",
     {"prepare": _prep_sizes(lambda s: json.dumps({**s, _first_key(s): "fifty"}))}),
    ("sizes_bool", {}, [f"data.train={S}"], "sizes.json",
     {"prepare": _prep_sizes(lambda s: json.dumps({**s, _first_key(s): True}))}),
    ("sizes_names_missing_shard", {}, [f"data.train={S}"], "sizes.json",
     {"prepare": _prep_sizes(lambda s: json.dumps({**s, "ghost-000999.tar": 10}))}),
    ("braces_no_match", {}, ["data.train={tmp}/shards-{{000000..000003}}.tar"], "shards-"),
    ("data_empty_string", {}, ["data.train="], "data.train"),
    ("data_empty_source", {}, ["data.train={data}/train::"], "data.train"),
    ("targets_source_typo", {}, ["targets.source=shard"], "targets.source"),
    ("targets_unembedded", {}, [f"data.train={S}"], "embed",
     {"prepare": lambda tmp, data: _copy_shards(tmp, data, json.dumps(_sizes(data))).joinpath(
         "manifest.json").write_text(json.dumps({k: v for k, v in json.loads(
             (data / "train" / "manifest.json").read_text()).items() if k != "embedding"}))}),
    ("targets_model_not_cached", {}, ["model.text_from_targets=false", "model.lock_text=false",
                                      "model.arch=mmpt-tiny-vit", "targets.source=online",
                                      "targets.model=nobody/no-such-encoder", "loss.0.name=soft_target"],
     "targets.model=nobody/no-such-encoder is not in the local Hugging Face cache"),
    # -- objectives
    ("loss_unknown", {}, ["loss.0.name=clipp"], "unknown objective 'clipp'"),
    ("loss_bad_option", {"loss": [{"name": "clip", "options": {"local_los": True}}]}, [],
     "bad options for objective 'clip'"),
    ("loss_option_value", {"loss": [{"name": "sigmoid", "options": {"chunk_size": -3}}]}, [], "loss.0"),
    ("loss_empty", {"loss": []}, [], "loss: give at least one term"),
    ("loss_string", {"loss": "clip"}, [], "loss"),
    ("loss_weight_word", {}, ["loss.0.weight=abc"], "loss.0.weight"),
    ("loss_weight_negative", {}, ["loss.0.weight=-1"], "loss.0.weight"),
    ("loss_weight_inf", {}, ["loss.0.weight=.inf"], "loss.0.weight"),
    ("regions_no_scales", {"loss": [{"name": "regions", "options": {"scales": []}}]}, [],
     "scales=[] must be a non-empty list"),
    ("regions_accumulate", {"loss": [{"name": "regions"}]},
     ["train.micro_batch_size=8", "train.micro_batch_mode=accumulate"], "loss regions needs the whole batch"),
    # -- evaluation during training
    ("eval_task_count", {"eval": {"every": 1, "datasets": ["{data}", "{data}"], "tasks": ["knn"] * 3}}, [],
     "one per entry of eval.datasets"),
    ("eval_task_unknown", {"eval": {"every": 1, "datasets": ["{data}"], "tasks": ["zero_shot"]}}, [],
     "'zero_shot' is not one of"),
    ("eval_every_zero", {"eval": {"every": 0, "datasets": ["{data}"], "tasks": ["knn"]}}, [], "eval.every"),
    ("eval_no_datasets", {"eval": {"every": 1, "datasets": [], "tasks": ["knn"]}}, [], "eval.datasets"),
    ("eval_dataset_missing", {"eval": {"every": 1, "datasets": ["{tmp}/no-such-eval"], "tasks": ["knn"]}}, [],
     "eval.datasets"),
    ("eval_no_every", {"eval": {"datasets": ["{data}"], "tasks": ["knn"]}}, [], "eval.every"),
    # -- hub
    ("hub_no_repo", {}, ["hub={push_every: 10}"], "hub.repo_id: required key is missing"),
    ("hub_offline", {"hub": {"repo_id": "me/run", "push_every": 1}}, [], "HF_HUB_OFFLINE",
     {"env": {"HF_HUB_OFFLINE": "1"}}),
    ("hub_repo_malformed", {"hub": {"repo_id": "a/b/c"}}, [], "hub.repo_id"),
    ("hub_push_every_zero", {"hub": {"repo_id": "me/run", "push_every": 0}}, [], "hub.push_every"),
    # -- run folder and resume
    ("run_dir_file", {"run_dir": "{tmp}/notes.txt"}, [], "run_dir", {"prepare": _prep_file("notes.txt")}),
    ("run_dir_under_file", {"run_dir": "{tmp}/notes.txt/run"}, [], "run_dir", {"prepare": _prep_file("notes.txt")}),
    ("resume_missing", {}, ["resume={tmp}/no-such-checkpoint"], "resume"),
    ("resume_not_checkpoint", {}, ["resume={tmp}/ckpt"], "resume", {"prepare": _prep_fake_ckpt}),
    # -- overrides themselves
    ("override_no_equals", {}, ["novalue"], "key.path=value"),
    ("override_empty_key", {}, ["=3"], "empty key"),
    ("override_empty_part", {}, ["train..steps=3"], "empty key"),
    ("override_list_index", {}, ["loss.3.weight=1"], "has no item 3"),
    ("override_into_value", {}, ["train.steps.max=3"], "train.steps is a value, not a section"),
    ("override_bad_flow_yaml", {}, ["eval={every: 10, datasets: [a"], "eval"),
]


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _fill(obj: Any, tmp: Path, data: Path) -> Any:
    if isinstance(obj, str):
        return obj.replace("{tmp}", str(tmp)).replace("{data}", str(data)).replace("{{", "{").replace("}}", "}")
    if isinstance(obj, list):
        return [_fill(o, tmp, data) for o in obj]
    if isinstance(obj, dict):
        return {k: _fill(v, tmp, data) for k, v in obj.items()}
    return obj


def materialise(case: tuple, tmp: Path, data: Path) -> tuple[list[str], dict[str, str], str]:
    """Write the case's files into ``tmp``; return the CLI arguments, extra environment and needle."""
    cid, yml, overrides, needle, *rest = case
    opts = rest[0] if rest else {}
    if "prepare" in opts:
        opts["prepare"](tmp, data)
    cfg = tmp / "c.yaml"
    kind = yml.get("__file__")
    if kind == "missing":
        pass
    elif kind == "dir":
        cfg.mkdir()
    elif kind == "text":
        cfg.write_text(yml["text"])
    elif kind == "bytes":
        cfg.write_bytes(yml["bytes"])
    else:
        cfg.write_text(yaml.safe_dump(_fill(_merge(_base(), yml), tmp, data)))
    return ["--config", str(cfg), *_fill(overrides, tmp, data)], opts.get("env", {}), _fill(needle, tmp, data)
