"""What a run writes into ``logging.dir`` once its first new step has completed.

Until then (the set-up, the first rollout, a reward that raises at once) the run directory stays
byte-identical to what it was: a failed ``--resume`` keeps the config that trained the
checkpoints, and a failed fresh run leaves no outputs. Then, in this order:

* ``metrics.jsonl`` loses the lines of steps after the resumed checkpoint (``truncate_jsonl``);
* ``config.yaml`` becomes this run's resolved config; a resume whose resolved config differs
  keeps the previous one as ``config.step{N}.yaml`` (N: the step it resumed from), so the
  settings of every stretch of the run stay on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from megatron_grpo.train.monitor import truncate_jsonl

CONFIG_NAME = "config.yaml"


def kept_config_path(log_dir: str | Path, start_step: int) -> Path:
    """``config.step{N}.yaml`` in ``log_dir`` (``.2``, ``.3`` ... when taken already)."""
    path = Path(log_dir) / f"config.step{start_step}.yaml"
    n = 2
    while path.exists():
        path = Path(log_dir) / f"config.step{start_step}.{n}.yaml"
        n += 1
    return path


def write_run_config(log_dir: str | Path, resolved: dict[str, Any], start_step: int) -> Path | None:
    """Write ``log_dir/config.yaml``; returns where the previous, different config was kept
    (None: there was none to keep)."""
    path = Path(log_dir) / CONFIG_NAME
    text = yaml.safe_dump(resolved, sort_keys=False)
    kept = None
    if start_step > 0 and path.is_file() and path.read_text(encoding="utf-8") != text:
        kept = kept_config_path(log_dir, start_step)
        os.replace(path, kept)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return kept


def start_outputs(cfg: Any, resolved: dict[str, Any], start_step: int) -> str | None:
    """The module docstring's writes; returns a line to print when a previous config was kept."""
    truncate_jsonl(cfg.logging.metrics_path, start_step)
    kept = write_run_config(cfg.logging.dir, resolved, start_step)
    if kept is None:
        return None
    return (
        f"config: the settings changed since step {start_step}: {kept.name} keeps the previous "
        f"config, {CONFIG_NAME} this run's"
    )
