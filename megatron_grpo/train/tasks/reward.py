"""Reward plug-ins by import path: ``"pkg.module:function"``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from megatron_grpo.train.tasks.base import Prompt, Tokenizer

RewardFn = Callable[[str, str, str], float]


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``fn`` from ``"pkg.module:fn"``; it is called as ``fn(prompt, response, answer)``
    with decoded strings and must return a float."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"rollout.reward_fn must look like 'pkg.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rollout.reward_fn: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"rollout.reward_fn: {module_name!r} has no callable {attr!r}")
    return fn


class PluginReward:
    """Adapts a ``fn(prompt, response, answer)`` plug-in to ``Task.reward``'s signature."""

    def __init__(self, fn: RewardFn, tokenizer: Tokenizer) -> None:
        self.fn = fn
        self.tokenizer = tokenizer

    def __call__(self, prompt: Prompt, response_ids: list[int]) -> float:
        ids = list(response_ids)
        if ids and ids[-1] == self.tokenizer.eos_id:
            ids = ids[:-1]
        value = self.fn(prompt.text, self.tokenizer.decode(ids), prompt.answer)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"reward_fn returned {type(value).__name__}, expected a float")
        return float(value)
