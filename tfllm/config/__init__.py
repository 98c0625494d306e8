"""Typed configuration: schema (defaults in one place) and strict loading/overrides (floor 5)."""
from tfllm.config.loader import ConfigError, dump_yaml, load_config, save_config, to_dict, validate
from tfllm.config.schema import (Config, DataConfig, MeshConfig, ModelConfig, OptimizerConfig,
                                 PrecisionConfig, TrainConfig)
