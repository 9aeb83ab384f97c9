"""Every config key with its type, default and description, read off the sections' pydantic models: the
table in docs/config.md is generated from here (``python scripts/reports/config_table.py --write``; a
test keeps it equal), so the reference cannot drift from what the config accepts."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from mmpretrain.config.sections import ExperimentConfig


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (``X``, ``X | None``, ``list[X]``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section(arg)
        if found is not None:
            return found
    return None


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(_type(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump(exclude_defaults=True) for v in value]
    return f"`{json.dumps(value)}`"


def rows(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(key, type, default, description)`` for every key, sections expanded (a list of sections, such
    as ``loss``, as ``loss[].name``)."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _section(field.annotation)
        if section is not None:
            listed = typing.get_origin(field.annotation) is list
            kind = "list of terms" if listed else "section, optional" if field.default is None else "section"
            if listed or field.description or field.default is None:
                out.append((key, kind, _default(field), field.description or ""))
            out += rows(section, f"{key}[]." if listed else f"{key}.")
            continue
        out.append((key, _type(field.annotation), _default(field), field.description or ""))
    return out


def table() -> str:
    lines = ["| key | type | default | what it sets |", "|---|---|---|---|"]
    for key, kind, default, doc in rows():
        lines.append(f"| `{key}` | {kind} | {default} | {doc.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)
