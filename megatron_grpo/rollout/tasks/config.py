"""The task sections of ``rollout:``: ``reverse_digits``, ``math`` and ``dataset`` (one per task,
beside the tasks that read them; ``rollout.task`` picks one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_grpo.config import check_positive

TaskName = Literal["reverse_digits", "math", "dataset"]
# rollout.reward_fn names usable without a module (tasks/verifiers.py's VERIFIERS).
BUILTIN_VERIFIERS = ("exact_match", "math")


@dataclass
class ReverseDigitsConfig:
    """The toy task: ``<bos> d1 .. dk =`` -> ``dk .. d1 <eos>`` (see ``tasks/reverse_digits.py``).

    ``num_digits``: k, an int, or ``[lo, hi]``: k drawn per prompt log-uniformly in
    ``[lo, hi]`` (from the prompt's seed), and each response cut at its answer's k + 1 tokens,
    so response lengths are long-tailed (the partial-rollout benchmark's task). The reward is
    the fraction of the k + 1 target tokens (digits, then ``<eos>``) that the response matches
    position by position.
    """

    num_digits: int | list[int] = 3

    def __post_init__(self) -> None:
        k = self.num_digits
        if isinstance(k, list):
            if len(k) != 2 or not 0 < k[0] <= k[1]:
                raise ValueError(
                    f"num_digits must be an int or [lo, hi] with 0 < lo <= hi, got {k}"
                )
        else:
            check_positive(self, "num_digits")

    @property
    def max_digits(self) -> int:
        return self.num_digits[1] if isinstance(self.num_digits, list) else self.num_digits


@dataclass
class MathTaskConfig:
    """A local JSONL of ``{"prompt": ..., "answer": ...}`` rows with a local HF tokenizer.

    ``tokenizer_dir`` is loaded with ``AutoTokenizer.from_pretrained`` from disk only (never a hub
    download). ``prompt_template`` wraps each prompt (``{prompt}`` is replaced). The built-in
    reward is 1.0 when the last number in the response equals the answer, else 0.0.
    """

    data_path: str = ""
    tokenizer_dir: str = ""
    prompt_template: str = "{prompt}"


DATASET_SUFFIXES = (".jsonl", ".parquet")


@dataclass
class DatasetConfig:
    """Prompts from ``.jsonl`` / ``.parquet`` files in verl's layout (``tasks/dataset.py``).

    A row holds ``prompt`` (a string, or a list of ``{"role", "content"}`` messages) and its
    ground truth, ``reward_model.ground_truth`` (verl) or ``answer`` (plain JSONL), with optional
    ``data_source`` (a string) and ``extra_info`` (a JSON object). Everything is read, templated,
    tokenized and checked at start-up; errors name the file, row and column.

    Attributes:
        train_files: the training prompts (files in this order; visited in a seeded
            permutation per epoch).
        val_files: validation prompts, loaded and checked the same way (``task.val_prompts()``).
        prompt_key: the column holding the prompt.
        tokenizer_dir: HF tokenizer files (``AutoTokenizer.from_pretrained``, local only); a
            ``generation_config.json`` there adds its ``eos_token_id`` (an id or a list) to the
            ids that end a response.
        chat_template: ``auto`` (apply the tokenizer's template when it has one; a message-list
            prompt without one is an error), ``true`` (always; a string prompt becomes one user
            message) or ``false`` (raw text; message-list prompts are an error).
        add_generation_prompt: end the templated prompt with the assistant turn's header.
        filter_overlong_prompts: drop prompts longer than ``rollout.max_prompt_length`` tokens
            (after the template) at load, reported once with their files and rows; false: such
            a prompt is a start-up error.
    """

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    tokenizer_dir: str = ""
    chat_template: bool | str = "auto"  # "auto", true or false (checked below)
    add_generation_prompt: bool = True
    filter_overlong_prompts: bool = True

    def __post_init__(self) -> None:
        for name in ("train_files", "val_files"):
            for i, path in enumerate(getattr(self, name)):
                if not path.endswith(DATASET_SUFFIXES):
                    raise ValueError(f"{name}[{i}]: {path!r} must end in .jsonl or .parquet")
        if not self.prompt_key:
            raise ValueError("prompt_key must not be empty")
        if self.chat_template not in ("auto", True, False):
            raise ValueError(
                f"chat_template must be auto, true or false, got {self.chat_template!r}"
            )
