"""Typed configuration (:mod:`.sections`: the dataclasses and their checks; :mod:`.loading`: YAML and
overrides): one dataclass per component, loaded from YAML with dotted CLI overrides.

    cfg = load_config("configs/tiny_cpu.yaml", ["objective.name=ar", "train.lr=3e-4"])

Every field has a type; YAML values and overrides are coerced to it (``"3e-4"`` -> float,
``"null"`` -> None) and an unknown or mistyped field stops with a :class:`ConfigError` that names the
field and suggests the fix. :func:`validate` checks the cross-field constraints of the method
(D <= S_max <= L, block size divides L, heads divide hidden size, ...). Configs are plain values:
nothing here is global or mutable after loading.
"""

from .loading import dump_yaml, from_dict, load_config, parse_overrides, to_dict
from .sections import (
    OBJECTIVE_NAMES,
    ConfigError,
    DataConfig,
    FaultConfig,
    LoggingConfig,
    ModelConfig,
    ObjectiveConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    validate,
    validate_layout,
)

__all__ = ["ConfigError", "ParallelConfig", "validate_layout", "ModelConfig", "ObjectiveConfig", "DataConfig",
           "TrainConfig", "LoggingConfig", "FaultConfig", "RunConfig", "load_config", "validate", "parse_overrides",
           "to_dict",
           "from_dict", "dump_yaml", "OBJECTIVE_NAMES"]
