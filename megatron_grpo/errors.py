"""The error type of bad user input, which the command-line tools report without a traceback."""

from __future__ import annotations


class InputError(ValueError):
    """Something the user gave cannot be used: a data or rollout file or one of its rows, a
    tokenizer directory, user code named in a recipe (``rollout.reward_fn``,
    ``rollout.source``), a config value (:class:`~megatron_grpo.config.ConfigError`). The message
    names the file (with its line or row) or the field, and says what to change.

    ``python -m megatron_grpo.train`` prints it as one ``error:`` line from one rank and exits 2,
    without a traceback (``train/__main__.py``). A ValueError, so callers that catch those keep
    working."""
