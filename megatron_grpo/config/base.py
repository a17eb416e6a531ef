"""Typed dataclass config trees loaded from YAML, with strict keys and dotted overrides.

Every config section is a ``@dataclass``. A YAML mapping maps 1:1 onto the tree:

* unknown keys raise :class:`ConfigError` naming the full dotted path and the closest valid key;
* values are checked against the field's annotation (int, float, bool, str, Literal, tuples,
  lists, ``X | None`` and nested dataclasses);
* ``--set a.b=value`` overrides are parsed as YAML scalars and applied before validation;
* a renamed key keeps working for a while: :func:`rename_keys` moves it to its new path with a
  deprecation message (both set is an error).

A section may be a runtime class itself (frozen or not): fields marked
``field(metadata=RUNTIME_ONLY)`` are filled in by the program, never by a recipe.

Cross-field checks belong in each dataclass's ``__post_init__`` and raise ``ValueError`` whose
message starts with the field's name; :func:`from_dict` re-raises them as :class:`ConfigError`
with the full dotted path (``rollout.sampling.temperature must be > 0``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from megatron_grpo.errors import InputError

T = TypeVar("T")

# ``field(metadata=RUNTIME_ONLY)``: a value the program fills in, not a recipe key.
RUNTIME_ONLY: Mapping[str, bool] = MappingProxyType({"recipe": False})


class ConfigError(InputError):
    """A config key or value is invalid; the message names its dotted path. ``key``: that path
    when one key is at fault (``rollout.num_prompts``), so a loader can point at its line."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# While :func:`collect_errors` is active: the errors found so far (None: raise the first one).
_COLLECTED: ContextVar[list[ConfigError] | None] = ContextVar("config_errors", default=None)


@contextlib.contextmanager
def collect_errors() -> Iterator[list[ConfigError]]:
    """Within this context :func:`from_dict` and :func:`apply_overrides` record each bad key or
    value in the yielded list and go on (a bad value keeps its default; a section whose checks
    fail is built unchecked), so one pass finds every mistake of a recipe."""
    errors: list[ConfigError] = []
    token = _COLLECTED.set(errors)
    try:
        yield errors
    finally:
        _COLLECTED.reset(token)


def report(error: ConfigError, cause: BaseException | None = None) -> None:
    """Record ``error`` while collecting (once per message), else raise it."""
    errors = _COLLECTED.get()
    if errors is None:
        raise error from cause
    if all(str(e) != str(error) for e in errors):
        errors.append(error)


def _closest(key: str, valid: Sequence[str]) -> str:
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    if match:
        return f"; did you mean '{match[0]}'?"
    return f"; valid keys: {', '.join(sorted(valid))}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def recipe_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that a recipe sets (not ``RUNTIME_ONLY``)."""
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("recipe", True)]


def field_message(path: str, message: str, names: Sequence[str]) -> str:
    """``message`` of section ``path``: one that starts with a field's name (``top_p must``,
    ``math.data_path``, ``train_files[0]``) names it by its dotted path, else ``path: message``."""
    head = re.match(r"\w+(?=[ .\[])", message)
    if head and head.group() in names:
        return f"{path}.{message}"
    return f"{path}: {message}"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``, converting YAML forms (list->tuple, int->float)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, path)
    if origin is Literal:
        value = _yaml_word(value, get_args(tp))
        if value not in get_args(tp):
            hint = f" ({_BARE_BOOL})" if isinstance(value, bool) else ""
            raise ConfigError(f"{path}: {value!r} is not one of {list(get_args(tp))}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{path}: expected a mapping for {tp.__name__}, got {value!r}"
                + _section_hint(tp, path, value)
            )
        return from_dict(tp, value, path)
    if origin in (tuple, list):
        return _coerce_sequence(value, tp, path)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    return _coerce_scalar(value, tp, path)


def _section_hint(cls: type, path: str, value: Any) -> str:
    """What to write instead of a plain value where a section is expected: its ``enabled``
    switch for a bool (``--set rollout.partial=true``), else its keys."""
    names = [f.name for f in recipe_fields(cls)]
    if isinstance(value, bool) and "enabled" in names:
        return f"; {path} is a section: did you mean '{path}.enabled={str(value).lower()}'?"
    return f"; {path} is a section with the keys {', '.join(names)}"


def _coerce_union(value: Any, tp: Any, path: str) -> Any:
    """``X | Y | None``: null where allowed, else the first option that accepts the value."""
    options = get_args(tp)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{path}: must not be null")
    real = [opt for opt in options if opt is not type(None)]
    if len(real) == 1:  # `X | None`: X's own errors, collected as usual
        return _coerce(value, real[0], path)
    errors = []
    token = _COLLECTED.set(None)  # each option is a trial: its first error rejects it
    try:
        for opt in real:
            try:
                return _coerce(value, opt, path)
            except ConfigError as e:
                errors.append(str(e))
    finally:
        _COLLECTED.reset(token)
    raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits none of {tp}")


def _coerce_sequence(value: Any, tp: Any, path: str) -> list | tuple:
    """``list[X]``, ``tuple[X, ...]`` or fixed-length ``tuple[X, Y]`` from a YAML list."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list, got {value!r}")
    origin, args = get_origin(tp), get_args(tp)
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
        pairs = zip(value, args, strict=True)
        items = [_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(pairs)]
    else:
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


_SCALAR_NAMES = {float: "a number", int: "an integer", bool: "true/false", str: "a string"}
# YAML 1.1 (PyYAML) reads a bare on / off / yes / no as true / false
_BARE_BOOL = "YAML reads a bare on / off / yes / no as true / false: quote it, e.g. 'off'"


def _yaml_word(value: Any, choices: tuple) -> Any:
    """The choice a YAML boolean stands for: ``off`` (False) or ``on`` (True) where it is one
    of ``choices``; anything else unchanged."""
    if isinstance(value, bool):
        word = "on" if value else "off"
        if word in choices and value not in choices:
            return word
    return value


def _coerce_scalar(value: Any, tp: Any, path: str) -> Any:
    """float (ints and YAML-1.1 strings like ``3e-4`` accepted), int, bool, str, other types."""
    if tp is float and isinstance(value, str):
        value = _float_or_same(value)  # YAML 1.1 reads `3e-4` (no dot) as a string
    if tp in _SCALAR_NAMES:
        accepted = (int, float) if tp is float else tp
        if (isinstance(value, bool) and tp is not bool) or not isinstance(value, accepted):
            hint = f" ({_BARE_BOOL})" if tp is str and isinstance(value, bool) else ""
            raise ConfigError(f"{path}: expected {_SCALAR_NAMES[tp]}, got {value!r}{hint}")
        return float(value) if tp is float else value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
    return value


def _float_or_same(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys and bad values are errors (all of
    them recorded under :func:`collect_errors`, else the first raised)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in recipe_fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = _join(path, key)
        if key not in fields:
            message = f"unknown config key '{dotted}'{_closest(key, list(fields))}"
            report(ConfigError(message, key=dotted))
            continue
        try:
            kwargs[key] = _coerce(value, hints[key], dotted)
        except ConfigError as e:
            e.key = e.key or dotted  # the innermost field that holds the bad value
            report(e)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        error = _check_error(cls, path, e, list(fields))
        report(error, cause=None if error is e else e)
        return _unchecked(cls, kwargs)
    except AttributeError:  # a check reading a stand-in above: a cascade of an error found
        if not _COLLECTED.get():
            raise
        return _unchecked(cls, kwargs)


def _check_error(cls: type, path: str, e: Exception, fields: list[str]) -> ConfigError:
    """A section's failed ``__post_init__`` as a ConfigError naming the dotted field."""
    if isinstance(e, ConfigError):
        return e
    if not path:  # the root: its messages name their sections
        return ConfigError(f"{cls.__name__}: {e}")
    message = field_message(path, str(e), fields)
    head = message[len(path) + 1 :].split(" ")[0].split(".")[0].split("[")[0]
    return ConfigError(message, key=_join(path, head) if head in fields else path)


def _unchecked(cls: type[T], kwargs: Mapping[str, Any]) -> T:
    """``cls`` with ``kwargs`` (defaults elsewhere) without its checks: a stand-in that lets
    error collection go on past a section that failed them."""
    obj = cls.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            value = kwargs[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        object.__setattr__(obj, f.name, value)
    return obj


def check_positive(obj: Any, *names: str) -> None:
    """``__post_init__`` helper: each named field must be > 0 when set (None is allowed)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config tree (tuples become lists), suitable for YAML."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in recipe_fields(type(v))}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(cfg)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str], root: type | None = None):
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict in place.

    With ``root`` (the tree's dataclass), an unknown path raises a :class:`ConfigError`
    that suggests the closest valid key, even when the YAML omitted that section (under
    :func:`collect_errors`: each bad override is recorded and skipped).
    """
    for item in overrides:
        try:
            _apply_override(data, item, root)
        except ConfigError as e:
            report(e)
    return data


def _apply_override(data: dict[str, Any], item: str, root: type | None) -> None:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must have the form a.b=value")
    dotted, raw = item.split("=", 1)
    keys = dotted.strip().split(".")
    value = yaml.safe_load(raw) if raw.strip() else ""
    node, cls = data, root
    for depth, key in enumerate(keys):
        path = ".".join(keys[: depth + 1])
        if cls is not None:
            names = [f.name for f in recipe_fields(cls)]
            if key not in names:
                raise ConfigError(f"unknown config key '{path}'{_closest(key, names)}")
            tp = get_type_hints(cls)[key]
            cls = _dataclass_in(tp)
        if depth == len(keys) - 1:
            node[key] = value
        else:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{dotted}': '{path}' is not a section")
            node = child


def rename_keys(
    data: dict[str, Any], overrides: Sequence[str], renamed: Mapping[str, str]
) -> list[str]:
    """Move renamed keys (``renamed``: old dotted path -> new one, applied in this order) to
    their new paths.

    ``data`` (a loaded YAML tree) is changed in place; the rewritten ``overrides`` are returned.
    An old key applies only to a value that is not a mapping, so a scalar at a path that is now a
    section (``rollout.engine: recompute``) can move into it (``rollout.engine.kind``). Each old
    key used warns once, on rank 0, naming the new one; old and new both set in the YAML, or both
    in the overrides, is a :class:`ConfigError` naming both.
    """
    used = []
    for old, new in renamed.items():
        parent = _node(data, old.split(".")[:-1])
        key = old.rsplit(".", 1)[-1]
        if not isinstance(parent, dict) or key not in parent or isinstance(parent[key], Mapping):
            continue
        if _node(data, new.split(".")) is not _MISSING:
            raise ConfigError(f"{old} and {new} are both set; {old} is deprecated: keep {new}")
        value = parent.pop(key)
        _setdefault_path(data, new.split(".")[:-1])[new.rsplit(".", 1)[-1]] = value
        used.append(old)
    given = {item.split("=", 1)[0].strip() for item in overrides}
    out = []
    for item in overrides:
        dotted, _, raw = item.partition("=")
        new = renamed.get(dotted.strip())
        if new is not None and "=" in item and not isinstance(_yaml_value(raw), Mapping):
            if new in given:
                raise ConfigError(
                    f"--set {dotted.strip()} and --set {new} are both given; "
                    f"{dotted.strip()} is deprecated: keep {new}"
                )
            item = f"{new}={raw}"
            used.append(dotted.strip())
        out.append(item)
    for old in dict.fromkeys(used):
        if os.environ.get("RANK", "0") == "0":
            message = f"config key {old} is deprecated and will be removed: use {renamed[old]}"
            warnings.warn(message, FutureWarning, stacklevel=3)
    return out


def _yaml_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


_MISSING = object()


def _node(data: Mapping[str, Any], keys: Sequence[str]) -> Any:
    """The value at ``keys`` below ``data`` (``_MISSING`` when absent or below a non-mapping)."""
    node: Any = data
    for k in keys:
        if not isinstance(node, Mapping) or k not in node:
            return _MISSING
        node = node[k]
    return node


def _setdefault_path(data: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    node = data
    for depth, k in enumerate(keys):
        if node.get(k) is None:
            node[k] = {}
        if not isinstance(node[k], dict):
            raise ConfigError(f"'{'.'.join(keys[: depth + 1])}' must be a section (a mapping)")
        node = node[k]
    return node


def _dataclass_in(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def load_yaml(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Load ``cls`` from a YAML file (or defaults when ``path`` is None) plus overrides."""
    data = load_yaml(path) if path is not None else {}
    apply_overrides(data, overrides, root=cls)
    return from_dict(cls, data)


__all__ = [
    "ConfigError",
    "check_positive",
    "collect_errors",
    "report",
    "apply_overrides",
    "from_dict",
    "load_config",
    "load_yaml",
    "recipe_fields",
    "rename_keys",
    "RUNTIME_ONLY",
    "to_dict",
]
