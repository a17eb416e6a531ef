"""Typed config machinery shared by every config section (see :mod:`.base`)."""

from megatron_grpo.config.base import (
    RUNTIME_ONLY,
    ConfigError,
    apply_overrides,
    check_positive,
    from_dict,
    load_config,
    load_yaml,
    recipe_fields,
    rename_keys,
    to_dict,
)

__all__ = [
    "RUNTIME_ONLY",
    "ConfigError",
    "apply_overrides",
    "check_positive",
    "from_dict",
    "load_config",
    "load_yaml",
    "recipe_fields",
    "rename_keys",
    "to_dict",
]
