"""docs/conversion.md's commands run as written (``tests/docs_pages.py``): the seeded stand-in,
converted to Megatron and back, each direction verified against transformers (TP 2, then 1).
The page runs once per session (``conversion_page`` in ``tests/conftest.py``), in the directory
where docs/byo_task.md ran before it."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_conversion_page_runs(conversion_page):
    tmp_path, outs = conversion_page  # run_page(docs/conversion.md), after docs/byo_task.md
    assert len(outs) == 3
    for out in outs:  # a few lines each, the libraries' warnings in OUT.warnings.log
        assert len(out.stdout.splitlines()) <= 10 and out.stderr == "", (out.stdout, out.stderr)
    assert "max |logit difference| transformers vs Megatron (TP=2)" in outs[1].stdout
    assert (tmp_path / "hf" / "qwen3_back" / "model.safetensors").is_file()
