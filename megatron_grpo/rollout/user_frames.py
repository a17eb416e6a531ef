"""Where in the user's own code an exception came from: ``path:line: source`` lines for the
error report of a failing reward function (``rollout/scoring.py``), without the frames of this
package, the standard library or installed packages."""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from pathlib import Path

_OURS = str(Path(__file__).resolve().parents[1]) + os.sep  # the megatron_grpo package
_LIBRARIES = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)
# A frame of a worker process's traceback, as concurrent.futures passes it on (text only).
_TEXT_FRAME = re.compile(
    r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in .*\n    (?P<src>.*)$', re.M
)


def _is_users(filename: str, own_file: str | None) -> bool:
    path = str(Path(filename).resolve())
    if own_file is not None and path == str(Path(own_file).resolve()):
        return True  # the reward function's own file, even inside an installed package
    if filename.startswith("<"):  # <string>, <frozen ...>: no file to point at
        return False
    return not path.startswith(_OURS) and not path.startswith(_LIBRARIES)


def _shown(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:  # outside the working directory: the full path
        return filename


def user_frames(error: BaseException, own_file: str | None = None, limit: int = 3) -> list[str]:
    """The innermost ``limit`` frames of ``error`` in the user's files, outermost first, as
    ``  path:line: source``. ``own_file``: the failing function's file (always the user's). A
    worker process's error carries its traceback as text (its ``__cause__``): read from that."""
    frames = [
        (f.filename, f.lineno, f.line or "") for f in traceback.extract_tb(error.__traceback__)
    ]
    remote = error.__cause__
    if remote is not None and type(remote).__name__ == "_RemoteTraceback":
        found = _TEXT_FRAME.finditer(getattr(remote, "tb", str(remote)))
        frames += [(m["file"], int(m["line"]), m["src"]) for m in found]
    mine = [f for f in frames if _is_users(f[0], own_file)][-limit:]
    return [f"  {_shown(file)}:{line}: {src.strip()}" for file, line, src in mine]
