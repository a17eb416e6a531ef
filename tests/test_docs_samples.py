"""Output samples in the docs are the commands' own output (they cannot go stale)."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_grpo.train.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_scale_md_dry_run_sample_matches_the_command(capsys):
    """docs/scale.md's memory-plan sample is every line the dry run prints from "memory plan"
    to the log-prob working set (the "peak" line between them left out)."""
    text = (ROOT / "docs" / "scale.md").read_text()
    command = "python -m megatron_grpo.train --config recipes/qwen3_8b_long_sp.yaml --dry-run"
    assert f"{command} --world-size 64" in text
    sample = re.search(r"```\n(memory plan per rank.*?)```", text, re.S).group(1).splitlines()
    recipe = str(ROOT / "recipes" / "qwen3_8b_long_sp.yaml")
    assert main(["--config", recipe, "--dry-run", "--world-size", "64"]) == 0
    printed = [x.rstrip() for x in capsys.readouterr().out.splitlines()]
    start = printed.index(sample[0])
    shown = [x for x in printed[start : start + len(sample) + 1] if not x.startswith("peak ")]
    assert shown == [x.rstrip() for x in sample]
