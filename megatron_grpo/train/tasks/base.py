"""What the trainer needs from a task: a tokenizer, prompts by index, and a reward."""

from __future__ import annotations

from dataclasses import dataclass
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
    """One prompt: its token ids, its text and the reference answer the reward checks."""

    ids: tuple[int, ...]
    text: str
    answer: str


class Task(Protocol):
    """A verifiable task. ``prompts(start, n)`` is a pure function of the indices (and the task's
    seed), so the data position of a run is just the number of prompts consumed."""

    tokenizer: Tokenizer

    def prompts(self, start: int, n: int) -> list[Prompt]: ...

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float: ...
