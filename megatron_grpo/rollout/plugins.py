"""User code named in a recipe: ``"pkg.module:name"`` or ``"path/to/file.py:name"``.

One loader for every such setting (``rollout.reward_fn``, ``rollout.source``); errors name the
setting. A ``.py`` file is imported under a name unique to its resolved path and registered in
``sys.modules``, so classes and pickling inside it find their module and a second load of the
same file returns the same module.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from megatron_grpo.errors import InputError


def load_object(spec: str, field: str, forms: str, kind: str = "callable") -> Any:
    """The callable named by ``spec`` (``"module:name"`` or ``"file.py:name"``); ValueErrors
    start with ``field`` and say which ``forms`` are accepted, and ``kind`` names what is missing
    ("callable", "class")."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise InputError(f"{field} must look like {forms}, got {spec!r}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = load_file(where, field)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise InputError(f"{field}: cannot import module {where!r}: {e}") from e
    obj = getattr(module, name, None)
    if not callable(obj):
        raise InputError(f"{field}: {where!r} has no {kind} {name!r}{_closest(module, name)}")
    return obj


def _closest(module: ModuleType, name: str) -> str:
    """``; did you mean 'x'?`` for the module's callable closest to ``name`` (or nothing)."""
    names = [k for k, v in vars(module).items() if callable(v) and not k.startswith("__")]
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def load_file(path: str, field: str) -> ModuleType:
    """The module of a ``.py`` file (relative to the working directory)."""
    file = Path(path)
    if not file.is_file():
        where = "" if file.is_absolute() else f" (relative to the working directory {Path.cwd()})"
        raise InputError(f"{field}: no file {path!r}{where}")
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    name = f"_megatron_grpo_plugin_{file.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise InputError(f"{field}: cannot load {path!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise InputError(f"{field}: loading {path!r} failed: {type(e).__name__}: {e}") from e
    return module
