"""Where a recipe's mistakes are: every error the config loader collected, led by the
``FILE:LINE`` of the key that caused it (an override's own errors have no line)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from megatron_grpo.config.base import ConfigError, _join


def yaml_key_lines(text: str) -> dict[str, int]:
    """The 1-based line of every mapping key of a YAML document, by dotted path (``a.b.c``)."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                dotted = _join(prefix, str(key.value))
                lines[dotted] = key.start_mark.line + 1
                walk(value, dotted)

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, "")
    return lines


def recipe_line(path: str | Path, key: str | None, overrides: Sequence[str]) -> int | None:
    """The line of the recipe that set ``key`` (or its closest enclosing section); None when
    no key is at fault or an override (``--set``) set it or a section above it."""
    if key is None:
        return None
    given = [item.split("=", 1)[0].strip() for item in overrides]
    if any(key == g or key.startswith(g + ".") for g in given):
        return None
    lines = yaml_key_lines(Path(path).read_text(encoding="utf-8"))
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if (line := lines.get(".".join(parts[:n]))) is not None:
            return line
    return None


def raise_collected(
    errors: Sequence[ConfigError], path: str | Path | None, overrides: Sequence[str]
) -> None:
    """Raise the errors :func:`collect_errors` found as one ConfigError (none: return): each
    on its own line, led by the recipe's ``FILE:LINE`` of its key (:func:`recipe_line`)."""
    if not errors:
        return
    lines = []
    for e in errors:
        line = recipe_line(path, e.key, overrides) if path is not None else None
        lines.append(f"{path}:{line}: {e}" if line is not None else str(e))
    if len(lines) == 1:
        raise ConfigError(lines[0], key=errors[0].key)
    where = f"{path} (with its --set overrides)" if overrides else f"{path or 'the config'}"
    head = f"{len(lines)} mistakes in {where}:"
    raise ConfigError("\n".join([head, *(f"  {text}" for text in lines)]))
