"""Run a docs page's commands as written (``tests/test_byo_task.py``,
``tests/test_docs_commands.py``).

In page order: a ``python`` block whose first line is ``# NAME.py: ...`` is written to NAME.py;
each line of a ``bash`` block is run (``python`` as this interpreter, ``torchrun`` as ``python -m
torch.distributed.run`` on a free port), in a scratch directory that links the repository's
``recipes/`` and ``tools/``. A ``bash`` block whose first line starts with ``# a real model``
needs a model the tests do not have: it is not run, but each of its commands must be one that
is run with other path arguments (``--hf``, ``--out``, ``--ckpt``).

The pages run once per session, in reader order in one directory (``byo_page`` then
``conversion_page`` in ``tests/conftest.py``): each page's test, the converter console's and the
reader-order test read those runs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL = "# a real model"
_PATH_OPTIONS = ("--hf", "--out", "--ckpt")


def blocks(page: Path) -> list[tuple[str, str]]:
    """``(language, body)`` of the page's python and bash blocks, in order."""
    return re.findall(r"```(python|bash)\n(.*?)```", page.read_text(), re.S)


def commands(body: str) -> list[list[str]]:
    """The commands of a bash block (``\\``-continued lines joined; comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", body)
    return [c for line in text.splitlines() if (c := shlex.split(line, comments=True))]


def shape(cmd: list[str]) -> list[str]:
    """``cmd`` with the values of its path options replaced (what a real-model command shares
    with the stand-in's)."""
    return ["PATH" if i and cmd[i - 1] in _PATH_OPTIONS else t for i, t in enumerate(cmd)]


def run_page(page: Path, cwd: Path, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Run ``page`` as described in the module docstring; every command must exit 0."""
    for name in ("recipes", "tools"):
        if not (cwd / name).is_symlink():  # a second page in the same directory
            (cwd / name).symlink_to(ROOT / name)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done, real = [], []
    for lang, body in blocks(page):
        if lang == "python":
            if m := re.match(r"# (\S+\.py):", body):
                (cwd / m.group(1)).parent.mkdir(parents=True, exist_ok=True)
                (cwd / m.group(1)).write_text(body)
            continue
        if body.startswith(REAL_MODEL):
            real += commands(body)
            continue
        for cmd in commands(body):
            out = subprocess.run(
                _launcher(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
            )
            assert out.returncode == 0, (cmd, out.stdout[-3000:], out.stderr[-3000:])
            done.append(out)
    ran = [shape(c) for c in _ran(page)]
    for cmd in real:
        assert shape(cmd) in ran, f"{page.name}: {shlex.join(cmd)} is no command that is run"
    return done


def _ran(page: Path) -> list[list[str]]:
    return [
        c
        for lang, body in blocks(page)
        if lang == "bash" and not body.startswith(REAL_MODEL)
        for c in commands(body)
    ]


def _launcher(cmd: list[str]) -> list[str]:
    if cmd[0] == "python":
        return [sys.executable, *cmd[1:]]
    if cmd[0] == "torchrun":  # a free port: other test runs may share the host
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--master-port",
            str(free_port()),
        ] + cmd[1:]
    raise AssertionError(f"a docs command starts with {cmd[0]!r}, not python or torchrun")
