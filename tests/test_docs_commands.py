"""docs/conversion.md's commands run as written (``tests/docs_pages.py``): the seeded stand-in,
converted to Megatron and back, each direction verified against transformers (TP 2, then 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_pages import run_page

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_conversion_page_runs(tmp_path):
    pytest.importorskip("transformers")
    outs = run_page(ROOT / "docs" / "conversion.md", tmp_path)
    assert len(outs) == 3
    for out in outs:  # a few lines each, the libraries' warnings in OUT.warnings.log
        assert len(out.stdout.splitlines()) <= 10 and out.stderr == "", (out.stdout, out.stderr)
    assert "max |logit difference| transformers vs Megatron (TP=2)" in outs[1].stdout
    assert (tmp_path / "hf" / "qwen3_back" / "model.safetensors").is_file()
