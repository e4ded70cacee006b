"""The config: a typed schema merged from defaults < preset < --config file < CLI key=value.

schema.py   the dataclasses (every field a default and a docstring), `walk`, the one walker
            of their fields, and the checks and hints built on ranges.py's tables
ranges.py   the table of numeric ranges, non-empty strings and paths (imports no schema)
rules.py    the strategy and world-size rules (no torch: `config check` applies them too)
load.py     merging the layers; every mistake a one-line UsageError naming the fix
explain.py  `trainer config explain`: each key's docstring (read from schema.py), type, range,
            default and resolved value
"""

from trainer.config.load import load, presets, to_dict, to_yaml
from trainer.config.ranges import MAX_SEED, NONEMPTY, RANGES, Range
from trainer.config.rules import check_world_size, resolve_strategy
from trainer.config.rules import layout as layout_of
from trainer.config.schema import (
    DEFAULT_PRESET,
    ArraysConfig,
    CkptConfig,
    Config,
    DataConfig,
    DistConfig,
    Field,
    FSDPConfig,
    GPTConfig,
    LogConfig,
    MLflowConfig,
    ModelConfig,
    OptimConfig,
    ReproConfig,
    SchedConfig,
    ShardsConfig,
    SyntheticConfig,
    TaskConfig,
    TextConfig,
    TokensConfig,
    TrainConfig,
    WandbConfig,
    example,
    range_hint,
    walk,
)

__all__ = [
    "DEFAULT_PRESET",
    "MAX_SEED",
    "NONEMPTY",
    "RANGES",
    "ArraysConfig",
    "CkptConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "FSDPConfig",
    "Field",
    "GPTConfig",
    "LogConfig",
    "MLflowConfig",
    "ModelConfig",
    "OptimConfig",
    "Range",
    "ReproConfig",
    "SchedConfig",
    "ShardsConfig",
    "SyntheticConfig",
    "TaskConfig",
    "TextConfig",
    "TokensConfig",
    "TrainConfig",
    "WandbConfig",
    "check_world_size",
    "example",
    "layout_of",
    "load",
    "presets",
    "range_hint",
    "resolve_strategy",
    "to_dict",
    "to_yaml",
    "walk",
]
