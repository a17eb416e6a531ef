"""A package face that imports its exports on first use (PEP 562): importing a light submodule
(a recipe section) must not import megatron-core through the package."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(
    package: str, exports: dict[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """The package's ``__getattr__``: ``exports`` maps a name to the module defining it; the
    first access imports it and caches it in the package's ``namespace``."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
