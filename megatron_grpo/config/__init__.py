"""Typed config machinery shared by every config section (see :mod:`.base`)."""

from megatron_grpo.config.base import (
    ConfigError,
    apply_overrides,
    check_positive,
    from_dict,
    load_config,
    load_yaml,
    to_dict,
)

__all__ = [
    "ConfigError",
    "apply_overrides",
    "check_positive",
    "from_dict",
    "load_config",
    "load_yaml",
    "to_dict",
]
