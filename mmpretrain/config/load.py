"""Defaults -> YAML file -> dotted ``key=value`` overrides -> a validated :class:`ExperimentConfig`, and
the config's flat and YAML views (the run folder's ``config.yaml``, a resume's comparison)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mmpretrain.config.sections import ConfigError, ExperimentConfig


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; check its spelling against the documented keys (README, Config)")
        elif e["type"] == "missing":
            lines.append(f"  {key}: required key is missing; add it to the YAML or pass {key}=...")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"  {key}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.path=value (e.g. train.steps=100)")
    key, raw = item.split("=", 1)
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _set_path(tree: dict, path: list[str], value: Any, full: str) -> None:
    node: Any = tree
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {full}: {'.'.join(path[:i])} has no item {part}")
            node = node[int(part)]
        else:
            if part not in node or node[part] is None:
                node[part] = {}
            node = node[part]
    last = path[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override {full}: {'.'.join(path[:-1])} has no item {last}")
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"override {full}: {'.'.join(path[:-1])} is a value, not a section")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Defaults -> YAML file -> dotted overrides, validated. Raises :class:`ConfigError`."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text ({e.reason} at byte {e.start}): "
                              "is it the YAML config?") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        tree = loaded or {}
        source = str(p)
    tree = json.loads(json.dumps(tree))  # deep copy with plain types
    for name, field_info in ExperimentConfig.model_fields.items():
        # list-valued defaults must exist in the tree for overrides such as loss.0.weight=2
        if name not in tree and field_info.default_factory is not None:
            default = field_info.default_factory()
            if isinstance(default, list):
                tree[name] = [d.model_dump() if isinstance(d, BaseModel) else d for d in default]
    for item in overrides or []:
        keys, value = parse_override(item)
        if keys in (["train", "steps"], ["train", "epochs"]) and value is not None and isinstance(tree.get("train"), dict):
            # the duration is one setting: the later one replaces the other (train.steps=N on an epochs config)
            tree["train"].pop("epochs" if keys[1] == "steps" else "steps", None)
        _set_path(tree, keys, value, item)
    if overrides:
        source += " + overrides"
    try:
        return ExperimentConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def to_yaml(cfg: ExperimentConfig, extra: dict[str, Any] | None = None) -> str:
    data = cfg.model_dump(mode="json")
    if extra:
        data["resolved"] = extra
    return yaml.safe_dump(data, sort_keys=False)


def config_defaults() -> dict[str, Any]:
    """Every key's default, flat (``data.train`` has none: a placeholder). A checkpoint written before a
    key existed trained with its default."""
    return flat_config(ExperimentConfig.model_validate({"data": {"train": "-"}}).model_dump(mode="json"))


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
