"""What the trainer needs from a task: a tokenizer, prompts by index, and a reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Tokenizer(Protocol):
    """The slice of a tokenizer the trainer uses (ids are plain ints)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, its text and the reference answer the reward checks.

    The optional fields come from datasets in verl's layout (``tasks/dataset.py``):
    ``data_source`` (which dataset / reward family the row belongs to), ``extra_info`` (the
    row's free-form JSON object, passed to rewards; not part of equality or hashing) and
    ``source`` (where the prompt came from, ``"path:row"``, for error messages).
    ``max_new_tokens``: the task's own response limit for this prompt (None: only
    ``rollout.max_response_length``; a longer one is cut at ``max_response_length``).
    """

    ids: tuple[int, ...]
    text: str
    answer: str
    data_source: str = ""
    extra_info: dict | None = field(default=None, hash=False, compare=False)
    source: str = ""
    max_new_tokens: int | None = None


class Task(Protocol):
    """A verifiable task. ``prompts(start, n)`` is a pure function of the indices (and the task's
    seed), so the data position of a run is just the number of prompts consumed.

    Optional: ``stop_ids`` (a tuple of token ids that end a response besides
    ``tokenizer.eos_id``; the generation adds them to ``rollout.sampling.stop_ids``)."""

    tokenizer: Tokenizer

    def prompts(self, start: int, n: int) -> list[Prompt]: ...

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float: ...
