"""All-or-nothing output directories: build in a hidden sibling, rename into place at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megatron_grpo.convert.errors import ConversionError


def check_output_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a Path; an error if it exists and is not an empty directory."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output directory {out} already exists and is not empty")
    return out


def _umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to ``out_dir``; on success it becomes ``out_dir``.

    On any exception the temporary directory is deleted, so no half-written output is left
    behind (an ``out_dir`` that existed empty before stays as it was).
    """
    out = check_output_dir(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    # mkdtemp makes it 0700; the output is an ordinary directory: the mode umask gives mkdir
    tmp.chmod(0o777 & ~_umask())
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty (checked above); os.replace cannot replace a directory
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
