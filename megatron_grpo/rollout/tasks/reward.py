"""Reward plug-ins: ``rollout.reward_fn`` names a function by import path
(``"pkg.module:function"``), by file (``"path/to/file.py:function"``) or a built-in verifier
(``exact_match``, ``math``: :mod:`megatron_grpo.rollout.tasks.verifiers`).

Calling convention, decided once from the function's signature:

* verl's: when it has a parameter named ``data_source``, ``solution_str``, ``ground_truth`` or
  ``extra_info`` (or ``**kwargs``), it is called with those keywords (the ones it accepts; all
  four with ``**kwargs``): ``solution_str`` is the decoded response, ``ground_truth`` the
  prompt's answer, ``data_source`` / ``extra_info`` the dataset row's (``extra_info`` ``{}``
  when the row has none).
* otherwise ``fn(prompt, response, answer)`` with the prompt's text, the decoded response and
  the answer.

It returns a number or a bool (1.0 / 0.0), or a dict with ``score`` (a number or bool) and any
other keys: the numeric ones are logged as ``reward/<key>`` (mean over the samples that have
it); others (e.g. verl's ``pred`` strings) are ignored. :func:`reward_value` checks it.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from megatron_grpo.errors import InputError
from megatron_grpo.rollout.plugins import load_object
from megatron_grpo.rollout.tasks.base import Prompt, Tokenizer
from megatron_grpo.rollout.tasks.verifiers import VERIFIERS

VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
# Metric names the trainer logs itself under reward/: a dict reward may not use them as keys.
RESERVED_EXTRAS = ("mean", "std", "timeouts")

_SPEC_FORMS = (
    "'pkg.module:function', 'path/to/file.py:function' or a built-in verifier "
    f"({', '.join(VERIFIERS)})"
)


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not a reward; the message names
    the function and the sample (``path:row`` of its prompt, else the prompt's index)."""


class RewardValueError(RewardError):
    """A reward function returned something that is not a reward (None, a string, NaN, a dict
    without ``score``): bad user code, exit code 2 like other bad input (a reward that raised
    is a failed run, exit code 1)."""


def _resolve(spec: str) -> Callable[..., Any]:
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    return load_object(spec, "rollout.reward_fn", _SPEC_FORMS)


def _verl_keywords(fn: Callable[..., Any], spec: str) -> tuple[str, ...] | None:
    """The verl keywords ``fn`` takes, or None for the ``fn(prompt, response, answer)`` form."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: the positional form
        return None
    params = sig.parameters
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        names = VERL_KEYWORDS
    else:
        names = tuple(k for k in VERL_KEYWORDS if k in params and params[k].kind in named)
    if not names:
        try:
            sig.bind("", "", "")
        except TypeError as e:
            raise InputError(
                f"rollout.reward_fn {spec!r} must take verl's keywords ({', '.join(VERL_KEYWORDS)})"
                f" or (prompt, response, answer): {e}"
            ) from None
        return None
    required = [
        p.name
        for p in params.values()
        if p.kind in named and p.default is inspect.Parameter.empty and p.name not in names
    ]
    if required:
        raise InputError(
            f"rollout.reward_fn {spec!r} takes verl's keywords but also requires {required}, "
            "which are never passed"
        )
    return names


class RewardFunction:
    """A loaded ``rollout.reward_fn``. ``keywords``: the verl keywords it is called with (None:
    the positional ``(prompt, response, answer)`` form). Pickles as its spec, so a function from
    a file is loaded again in a reward worker process."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fn = _resolve(spec)
        self.keywords = _verl_keywords(self.fn, spec)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (RewardFunction, (self.spec,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def load_reward_fn(spec: str) -> RewardFunction:
    """The function named by ``spec`` (see the module docstring); errors name
    ``rollout.reward_fn``."""
    return RewardFunction(spec)


def _as_number(value: Any) -> float | None:
    if isinstance(value, (bool, np.bool_)):
        return float(bool(value))
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def reward_value(value: Any, name: str, where: str) -> tuple[float, dict[str, float]]:
    """``(score, extras)`` of a reward function's return ``value``; :class:`RewardError` naming
    the function (``name``, e.g. ``rollout.reward_fn 'pkg.mod:fn'``) and the sample ``where``
    for anything but a finite number, a bool or a dict with such a ``score``."""
    extras: dict[str, float] = {}
    raw = value
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardValueError(
                f"{name} returned a dict without 'score' for {where} "
                f"(keys: {sorted(map(str, value))})"
            )
        for key, v in value.items():
            if key == "score":
                continue
            if key in RESERVED_EXTRAS:
                raise RewardValueError(
                    f"{name} returned the key {key!r} for {where}: reward/{key} is the "
                    f"trainer's own metric (reserved: {', '.join(RESERVED_EXTRAS)})"
                )
            number = _as_number(v)
            if number is not None:
                extras[str(key)] = number
        raw = value["score"]
    score = _as_number(raw)
    if score is None:
        what = "a dict whose 'score' is " if raw is not value else ""
        raise RewardValueError(
            f"{name} returned {what}{type(raw).__name__} for {where}; expected a number, "
            "a bool or a dict with a numeric 'score'"
        )
    if not math.isfinite(score):
        raise RewardValueError(f"{name} returned the non-finite score {score} for {where}")
    return score, extras


class PluginReward:
    """Adapts a :class:`RewardFunction` to ``Task.reward``: decodes the response (its final eos
    stripped) and calls the function in its convention.

    The scoring helper (``rollout/scoring.py``) uses :meth:`call_args` and ``fn`` separately (the
    call may run in a worker process); calling the object returns the checked score."""

    def __init__(self, fn: RewardFunction, tokenizer: Tokenizer) -> None:
        self.fn = fn
        self.tokenizer = tokenizer
        self.name = f"rollout.reward_fn {fn.spec!r}"

    def call_args(self, prompt: Prompt, response_ids: list[int]) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` of ``fn`` for this sample."""
        ids = list(response_ids)
        if ids and ids[-1] == self.tokenizer.eos_id:
            ids = ids[:-1]
        response = self.tokenizer.decode(ids)
        if self.fn.keywords is None:
            return (prompt.text, response, prompt.answer), {}
        values = {
            "data_source": prompt.data_source,
            "solution_str": response,
            "ground_truth": prompt.answer,
            "extra_info": dict(prompt.extra_info or {}),
        }
        return (), {k: values[k] for k in self.fn.keywords}

    def __call__(self, prompt: Prompt, response_ids: list[int]) -> float:
        args, kwargs = self.call_args(prompt, response_ids)
        where = prompt.source or "a prompt"
        return reward_value(self.fn(*args, **kwargs), self.name, where)[0]
