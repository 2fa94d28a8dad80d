"""Typed configuration: the schema (``HybridFlowConfig``) and the validating loader."""

from hybridflow.config.loader import (
    ConfigError,
    available_recipes,
    config_to_dict,
    load_config,
    need_critic,
    resolve_recipe,
)
from hybridflow.config.schema import HybridFlowConfig

__all__ = [
    "ConfigError",
    "HybridFlowConfig",
    "available_recipes",
    "config_to_dict",
    "load_config",
    "need_critic",
    "resolve_recipe",
]
