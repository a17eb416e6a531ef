"""docs/byo_task.md runs as written (``tests/docs_pages.py``): the seeded tiny Qwen3 stand-in
(``tools/convert_checkpoint.py tiny-hf``) converted, the page's data script and reward file, and
its torchrun command on ``recipes/byo_task.yaml`` (TP 2, gloo), in ``tmp_path``.
``metrics.jsonl`` holds eval/ metrics at step 0, at the interval and at the end, and the reward
metrics of every step; the step-0 evaluation is the one in the page's table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.docs_pages import REAL_MODEL, blocks, commands

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "byo_task.md"


def test_doc_is_linked_and_names_the_recipe():
    assert "docs/byo_task.md" in (ROOT / "README.md").read_text()
    assert "byo_task.md" in (ROOT / "docs" / "trainer.md").read_text()
    cmds = [c for lang, body in blocks(DOC) if lang == "bash" for c in commands(body)]
    train = [c for c in cmds if c[0] == "torchrun"]
    assert len(train) == 1 and train[0][train[0].index("--config") + 1] == "recipes/byo_task.yaml"
    real = [c for lang, b in blocks(DOC) if b.startswith(REAL_MODEL) for c in commands(b)]
    assert real and all(c[c.index("--out") + 1] == "ckpt/byo" for c in real)
    assert ["python", "tools/convert_checkpoint.py", "tiny-hf"] == next(
        c[:3] for c in cmds if "tiny-hf" in c
    )


def _table_column(step: int) -> dict[str, float]:
    """The page's table: the value of each eval key at ``step``."""
    rows = re.findall(r"^\| `(eval/\w+)` \|((?: [\d.]+ \|)+)$", DOC.read_text(), re.M)
    head = re.search(r"^\| step \|(.*)\|$", DOC.read_text(), re.M).group(1).split("|")
    col = [int(x) for x in head].index(step)
    return {key: float(vals.split("|")[col]) for key, vals in rows}


@pytest.mark.slow
def test_byo_task_page_runs(byo_page):
    tmp_path, outs = byo_page  # run_page(DOC, tmp_path), shared by the reader-order tests
    assert "eval at step 0: reward" in outs[-1].stdout
    run = tmp_path / "runs" / "byo_task"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(21))
    suffixes = ("reward_mean", "pass_at_1", "pass_at_4", "response_length")
    keys = {f"eval/{s}" for s in suffixes}
    keys |= {f"eval/toy/{op}/{s}" for op in ("plus", "minus") for s in suffixes}
    for m in lines:
        evals = {k for k in m if k.startswith("eval/")}
        assert evals == (keys if m["step"] % 5 == 0 else set()), (m["step"], sorted(m))
        if evals:
            assert 0.0 <= m["eval/pass_at_1"] <= m["eval/pass_at_4"] <= 1.0
            assert 0.0 <= m["eval/reward_mean"] <= 1.0 and m["eval/response_length"] >= 1
            assert m["perf/eval_seconds"] > 0
        if m["step"] == 0:  # before training: the evaluation only
            assert set(m) == keys | {"step", "perf/eval_seconds"}
        else:  # the verl-signature dict reward: its score and its extra key
            assert 0.0 <= m["reward/mean"] <= 1.0 and 0.0 <= m["reward/answered"] <= 1.0
            assert m["optim/skipped_steps"] == 0.0
    # the seeded stand-in's evaluation before training is the page's (no training involved)
    got = {k: round(lines[0][k], 3) for k in _table_column(0)}
    assert got == _table_column(0), (got, _table_column(0))
    assert (tmp_path / "runs" / "byo_task" / "checkpoints" / "latest").is_file()
