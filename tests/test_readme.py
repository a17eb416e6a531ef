"""The README's Python examples run as written (so the documented API cannot rot)."""

import ast
import itertools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_quick_start_commands():
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [ln for ln in quick.splitlines() if ln.strip()]
    assert len(lines) == 2
    assert all(ln.startswith("pip install -e ") for ln in lines)
    assert (
        "torchrun --nproc-per-node 2 -m megatron_grpo.train --config recipes/tiny.yaml" in lines[0]
    )
    assert "pytest" in lines[1]


def _run_example(index: int, tmp_path: Path) -> str:
    blocks = _python_blocks()
    assert len(blocks) >= 2, "README lost one of its Python examples"
    script = tmp_path / "example.py"
    script.write_text(blocks[index])
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _printed(out: str, label: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith(label)]
    assert len(lines) == 1, (label, out)
    return lines[0][len(label) :].strip()


def test_readme_api_example_prints_what_its_comments_say(tmp_path):
    """The library-API example prints the log-probs, the advantages, a loss equal to the value
    its comment derives by hand, the metrics and a zero gradient at the prompt rows."""
    out = _run_example(0, tmp_path)
    logp = ast.literal_eval(_printed(out, "log-probs:"))
    prompt = [0, 1, 5, 6]
    assert len(logp) == 12 and all(logp[i] == 0.0 for i in prompt)
    assert all(-12.0 < x < -3.0 for i, x in enumerate(logp) if i not in prompt)  # ~ -ln(1000)
    assert ast.literal_eval(_printed(out, "advantages:")) == [0.7071, -0.7071]
    # token_mean over the 3 + 5 response tokens, ratio 1, IS weight e^0.01 (sequence_mean)
    want = -(3 - 5) * 0.5**0.5 * math.exp(0.01) / 8
    assert float(_printed(out, "loss")) == pytest.approx(want, abs=1e-4)
    metrics = ast.literal_eval(next(ln for ln in out.splitlines() if ln.startswith("{")))
    assert metrics["is/weight_mean"] == pytest.approx(math.exp(0.01), abs=1e-4)
    assert metrics["loss/ratio_mean"] == 1.0
    assert float(_printed(out, "gradient at prompt rows:")) == 0.0


def test_readme_megatron_example_trains(tmp_path):
    """The Megatron-script example makes several optimizer steps on one rollout batch: the first
    at ratio 1 (the policy is the one that sampled), then the ratios spread and the loss falls at
    every step until PPO clipping holds the policy."""
    out = _run_example(1, tmp_path)
    pattern = re.compile(
        r"step (\d+): loss (\S+)  ratio (\S+)\.\.(\S+)  clipped (\S+)  grad norm (\S+)"
    )
    rows = [tuple(map(float, m.groups())) for m in map(pattern.fullmatch, out.splitlines()) if m]
    assert [int(r[0]) for r in rows] == list(range(len(rows))) and len(rows) >= 4, out
    losses = [r[1] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert all(b < a - 1e-3 for a, b in itertools.pairwise(losses)), losses
    assert rows[0][2:4] == (1.0, 1.0) and rows[0][4] == 0.0
    assert rows[-1][2] < 0.9 and rows[-1][3] > 1.1  # the policy moved away from the sampler
    assert rows[-1][4] > 0.0  # and clipping engaged


def test_megatron_usage_doc_shows_the_readme_example():
    """docs/megatron_usage.md repeats the README's Megatron example: it must not drift."""
    usage = (README.parent / "docs" / "megatron_usage.md").read_text()
    assert re.findall(r"```python\n(.*?)```", usage, re.S) == [_python_blocks()[1]]


# A count of tests in the README: "1,107 tests", "44 multi-process" / "44 slow" runs, or a run's
# "922 passed" / "141 skipped" (which --collect-only cannot confirm: always stale, never stated).
_COUNT = re.compile(r"(\d[\d,]*) (tests|passed|skipped|slow|multi-process)\b")


def readme_counts(text: str) -> list[tuple[int, str]]:
    return [(int(n.replace(",", "")), kind) for n, kind in _COUNT.findall(text)]


def count_mismatches(claims: list[tuple[int, str]], collected: dict[str, int]) -> list[str]:
    """The README's claims that ``collected`` (``tests``: all, ``slow``: marked slow)
    contradicts."""
    kinds = {"tests": "tests", "slow": "slow", "multi-process": "slow"}
    return [
        f"README says {n} {kind}; --collect-only: {collected[kinds[kind]]}"
        if kind in kinds
        else f"README says {n} {kind}: a run's outcome, not checkable; remove it"
        for n, kind in claims
        if kind not in kinds or collected[kinds[kind]] != n
    ]


def _collected(*marker: str) -> int:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        *marker,
        str(README.parent / "tests"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    return int(re.search(r"(\d+)(?:/\d+)? tests? collected", out).group(1))


def test_readme_test_counts_agree_with_collect_only():
    """Collects only when the README states a count (it states none: counts go stale with every
    test added)."""
    claims = readme_counts(README.read_text())
    if claims:
        collected = {"tests": _collected(), "slow": _collected("-m", "slow")}
        assert not count_mismatches(claims, collected)


def test_a_stale_readme_count_is_reported():
    text = "runs 1,107 tests; without the 44 multi-process runs: 922 passed, 141 skipped"
    assert count_mismatches(readme_counts(text), {"tests": 1225, "slow": 44}) == [
        "README says 1107 tests; --collect-only: 1225",
        "README says 922 passed: a run's outcome, not checkable; remove it",
        "README says 141 skipped: a run's outcome, not checkable; remove it",
    ]
