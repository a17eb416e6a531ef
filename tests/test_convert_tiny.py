"""``tools/convert_checkpoint.py tiny-hf``: the seeded stand-in model of every family we convert
(same seed, same bytes), convertible as it is; and the converter's console: a few lines on
success, the libraries' warnings in OUT.warnings.log beside the output (never inside it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_grpo.convert import FAMILIES, ConversionError, hf_to_mcore
from megatron_grpo.convert.tiny import save_tiny_hf

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers")


def test_the_same_seed_writes_the_same_model(tmp_path):
    a, b = save_tiny_hf("qwen3", tmp_path / "a", 0), save_tiny_hf("qwen3", tmp_path / "b", 0)
    c = save_tiny_hf("qwen3", tmp_path / "c", 1)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_converts(tmp_path, family):
    ckpt = hf_to_mcore(save_tiny_hf(family, tmp_path / "hf", 0), tmp_path / "ckpt")
    assert (ckpt / "model_config.yaml").is_file() and (ckpt / "hf" / "tokenizer.json").is_file()


def test_bad_family_and_a_used_out_dir_are_errors(tmp_path):
    with pytest.raises(ConversionError, match="not one of"):
        save_tiny_hf("gpt2", tmp_path / "x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "f").write_text("")
    with pytest.raises(ConversionError, match="not an empty directory"):
        save_tiny_hf("qwen3", tmp_path / "used")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_converter_console_is_a_few_lines(tmp_path, conversion_page):
    """tiny-hf, then hf-to-mcore --verify at TP 2 (spawned workers): each at most 10 lines,
    nothing on stderr, the warnings counted into OUT.warnings.log; an error is one line. The
    two runs are docs/conversion.md's first two commands (``conversion_page``, tests/conftest.py:
    run once per session, in one directory after docs/byo_task.md)."""
    cwd, outs = conversion_page
    runs = [
        ("tiny-hf", "--family", "qwen3", "--out", "hf/qwen3", "--seed", "0"),
        ("hf-to-mcore", "--hf", "hf/qwen3", "--out", "ckpt/qwen3", "--verify", "--tp", "2"),
    ]
    for args, out in zip(runs, outs[:2], strict=True):
        assert out.args[1:] == ["tools/convert_checkpoint.py", *args], out.args
        assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
        lines = out.stdout.splitlines()
        assert len(lines) <= 10 and lines[-1] == f"wrote {args[args.index('--out') + 1]}", lines
    assert "third-party warning(s) in ckpt/qwen3.warnings.log" in out.stdout
    assert "verify: max |logit difference|" in out.stdout
    outs = [cwd / args[args.index("--out") + 1] for args in runs]
    assert not [p for out in outs for p in out.glob("**/warnings.log")]  # no output folder
    bad = _cli("hf-to-mcore", "--hf", "nowhere", "--out", "x", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout
    assert bad.stderr.startswith("error: ") and len(bad.stderr.splitlines()) == 1, bad.stderr
