"""The README's Python examples run as written (so the documented API cannot rot)."""

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


@pytest.mark.parametrize("index", range(2))
def test_readme_python_example_runs(index, tmp_path):
    blocks = _python_blocks()
    assert len(blocks) >= 2, "README lost one of its Python examples"
    script = tmp_path / "example.py"
    script.write_text(blocks[index])
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
