"""Running a test module's Triton kernels on CPU, in Triton's interpreter.

Triton builds its own library for the interpreter only when TRITON_INTERPRET=1 is set before its
first import (megatron.core imports it), so a module's ``interpreter``-named tests run in a fresh
``pytest`` process with that variable set (:func:`run_interpreter_tests`); in the main process
they skip (:data:`interpreter_only`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

# Triton's own library was built for the interpreter (TRITON_INTERPRET=1 before its import).
IN_INTERPRETER = type(triton.language.zeros).__name__ == "InterpretedFunction"
interpreter_only = pytest.mark.skipif(
    not IN_INTERPRETER, reason="runs under TRITON_INTERPRET=1 in test_interpreter_subprocess"
)


def run_interpreter_tests(module_file: str, timeout: int = 600) -> None:
    """Run ``module_file``'s tests named ``*interpreter*`` in a fresh process under the
    interpreter; every one of them must run and pass (only the driver itself may skip)."""
    if IN_INTERPRETER:
        pytest.skip("already inside the interpreter run")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("MEGATRON_GRPO_AUTOTUNE", None)
    cmd = [sys.executable, "-m", "pytest", module_file, "-q", "-x", "-p", "no:cacheprovider"]
    cmd += ["-m", "not gpu", "-k", "interpreter"]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    skipped = re.search(r"(\d+) skipped", summary)
    assert "passed" in summary and (skipped is None or skipped.group(1) == "1"), summary
