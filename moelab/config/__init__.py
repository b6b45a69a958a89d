"""The one config dialect: dataclasses (moelab.config.schema), YAML I/O (yaml_io), the rules a Config obeys
(rules, lora). Everything public lives in schema; this face re-exports it so `from moelab.config import Config`
reads as it always has."""
from moelab.config.lora import LoRAConfig  # noqa: F401
from moelab.config.rules import ConfigError  # noqa: F401
from moelab.config.schema import (  # noqa: F401
    MoEConfig,
    RopeScalingConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    BackendConfig,
    DataConfig,
    Config,
    flatten,
    parse_override,
    load_config,
    save_config,
)
