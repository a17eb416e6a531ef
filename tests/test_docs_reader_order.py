"""The docs read as one session (issue 39): docs/byo_task.md then docs/conversion.md run in one
directory without the second page's commands meeting the first page's outputs; converter
warnings never land in an output folder; README and docs/trainer.md agree on the tiny task's
chance level, computed here."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.docs_pages import REAL_MODEL, blocks, commands

ROOT = Path(__file__).resolve().parents[1]
READER_ORDER = ("byo_task.md", "conversion.md")


def _runnable(page: str) -> list[list[str]]:
    return [
        cmd
        for lang, body in blocks(ROOT / "docs" / page)
        if lang == "bash" and not body.startswith(REAL_MODEL)
        for cmd in commands(body)
    ]


def _outs(page: str) -> set[str]:
    return {c[i + 1] for c in _runnable(page) for i, t in enumerate(c[:-1]) if t == "--out"}


def test_pages_in_reader_order_write_distinct_outputs():
    first, second = (_outs(p) for p in READER_ORDER)
    assert first and second and not first & second, first & second


@pytest.mark.slow
def test_converter_commands_in_reader_order_run_in_one_directory(byo_page, conversion_page):
    """Both pages run as written in one directory, byo_task first (``byo_page`` then
    ``conversion_page``, tests/conftest.py; each exits 0 or the fixture fails): every `--out`
    of either page is there; no output folder holds a warnings.log."""
    cwd = byo_page[0]
    assert conversion_page[0] == cwd
    outs = [cwd / out for page in READER_ORDER for out in _outs(page)]
    assert len(outs) == 5 and all(out.is_dir() for out in outs), outs
    found = [p for out in outs for p in out.glob("**/warnings.log")]
    assert not found, found


def _chance(k: int) -> float:
    """The expected reverse_digits reward of a uniform guess over the 13 tokens, by enumerating
    every k + 1 draws (a drawn <eos> ends the response), with the task's own reward."""
    from megatron_grpo.rollout.tasks.reverse_digits import ReverseDigitsTask

    task = ReverseDigitsTask(k, 0)
    prompt, eos = task.prompts(0, 1)[0], task.tokenizer.eos_id
    draws = list(itertools.product(range(13), repeat=k + 1))  # equally likely
    total = 0.0
    for seq in draws:
        cut = seq.index(eos) + 1 if eos in seq else k + 1  # the response ends at its <eos>
        total += task.reward(prompt, list(seq[:cut]))
    return total / len(draws)


def test_readme_and_trainer_docs_agree_on_the_chance_level():
    chance = _chance(3)
    assert abs(chance - 0.068) < 5e-4 and abs(chance - (1 - (12 / 13) ** 4) / 4) < 1e-12
    readme = (ROOT / "README.md").read_text()
    trainer = (ROOT / "docs" / "trainer.md").read_text()
    assert "0.059 is the untrained model's chance level" not in readme
    assert "0.068" in readme and "0.068" in trainer and "scores 1/13 (0.077)" not in trainer
