"""Third-party warnings out of the console: ``WarningLog`` collects the ``warnings.warn`` calls
made in the files of megatron-core, torch, Transformer Engine, Apex and the Hugging Face
libraries, and their loggers' records at WARNING and above, into a ``warnings.log`` file, and
the console gets one count line. The trainer writes the log to ``logging.dir``; the converter
(``tools/convert_checkpoint.py``) beside its output directory, as ``OUT.warnings.log`` (a Hugging
Face folder holds only what is uploaded). Our own warnings print as usual.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

# Warnings of these libraries (by file) and records of these loggers go to the run's warnings log.
_NOISY_PATHS = tuple(
    os.sep + os.path.join(*p) + os.sep
    for p in (
        ("megatron", "core"),
        ("torch",),
        ("transformer_engine",),
        ("apex",),
        ("transformers",),
        ("tokenizers",),
        ("huggingface_hub",),
        ("safetensors",),
    )
)
_NOISY_LOGGERS = (
    "megatron",
    "torch",
    "transformer_engine",
    "apex",
    "transformers",
    "huggingface_hub",
)


class WarningLog:
    """A context that collects the libraries' warnings (``warnings.warn`` from their files, and
    their loggers' records at WARNING and above) instead of printing them.
    ``attach(path)`` (rank 0, once the run directory is claimed) writes them, and those after,
    to ``path``; a rank that never attaches drops them. Other warnings print as usual."""

    def __init__(self) -> None:
        self.count = 0
        self.path: Path | None = None
        self._buffer: list[str] = []
        self._file = None

    def __enter__(self) -> WarningLog:
        self._show = warnings.showwarning
        warnings.showwarning = self._showwarning
        self._handler = _ListHandler(self._add)
        self._loggers = []
        for name in _NOISY_LOGGERS:
            logger = logging.getLogger(name)
            self._loggers.append((logger, logger.propagate))
            logger.addHandler(self._handler)
            logger.propagate = False
        return self

    def __exit__(self, *exc) -> None:
        warnings.showwarning = self._show
        for logger, propagate in self._loggers:
            logger.removeHandler(self._handler)
            logger.propagate = propagate
        if self._file is not None:
            self._file.close()
            self._file = None

    def attach(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
        for text in self._buffer:
            self._file.write(text + "\n")
        self._file.flush()
        self._buffer = []

    def count_line(self) -> str | None:
        """The console's line about the collected warnings (None: there are none)."""
        if not self.count or self.path is None:
            return None
        return f"{self.count} third-party warning(s) in {self.path}"

    def _showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if not any(p in str(filename) for p in _NOISY_PATHS):
            self._show(message, category, filename, lineno, file, line)
            return
        self._add(warnings.formatwarning(message, category, filename, lineno, line).rstrip())

    def _add(self, text: str) -> None:
        self.count += 1
        if self._file is not None:
            self._file.write(text + "\n")
            self._file.flush()
        else:
            self._buffer.append(text)


class _ListHandler(logging.Handler):
    def __init__(self, add) -> None:
        super().__init__(logging.WARNING)
        self._add_text = add

    def emit(self, record: logging.LogRecord) -> None:
        self._add_text(f"{record.levelname} {record.name}: {record.getMessage()}")


def run_collecting(target: str, *args: Any) -> Any:
    """Entry point of a spawned helper process: ``target`` (``"module:function"``, imported here,
    after the collection starts) called with ``args``. The libraries' warnings are collected and
    dropped: they repeat the parent's, which the parent logs (as the trainer's non-logging ranks
    drop theirs)."""
    with WarningLog():
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(*args)
