"""Typed, validated experiment config: defaults -> YAML -> dotted ``key=value`` overrides.

Every section is a pydantic model that rejects unknown keys (:mod:`~mmpretrain.config.sections`), so a
typo fails before any work with a message naming the key; cross-field checks live there too, each with a
message that says the fix. :mod:`~mmpretrain.config.load` reads the YAML and the overrides. Durations
that need the dataset size or the world size (epochs -> steps) are the trainer's to resolve, once
(:func:`mmpretrain.train.schedule.resolve_schedule`); it writes the resolved values with the config into
the run folder.
"""

from mmpretrain.config.base import ConfigError, RemoteConfig
from mmpretrain.config.load import config_defaults, flat_config, load_config, parse_override, to_yaml
from mmpretrain.config.sections import (
    DataConfig,
    EvalConfig,
    ExperimentConfig,
    HubConfig,
    LossTerm,
    ModelConfig,
    OptimConfig,
    TargetsConfig,
    TrainConfig,
)

__all__ = ["ConfigError", "DataConfig", "EvalConfig", "ExperimentConfig", "HubConfig", "LossTerm", "ModelConfig",
           "OptimConfig", "RemoteConfig", "TargetsConfig", "TrainConfig", "config_defaults", "flat_config",
           "load_config", "parse_override", "to_yaml"]
