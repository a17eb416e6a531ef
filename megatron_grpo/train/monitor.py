"""Run outputs on the logging rank: resolved config, JSONL metrics, progress line, TensorBoard."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from megatron_grpo.train.config import LoggingConfig

# (label, metric key, format) of the progress line.
_PROGRESS = (
    ("reward", "reward/mean", ".3f"),
    ("loss", "loss/loss", ".4f"),
    ("kl", "loss/kl_mean", ".4f"),
    ("clip", "loss/clipfrac", ".3f"),
    ("gen tok/s", "perf/generation_tokens_per_s", ".0f"),
    ("train tok/s", "perf/train_tokens_per_s", ".0f"),
)
# Where a step's time goes: "1.52s = rollout 0.90 + logprob 0.20 + update 0.40".
_STAGES = ("rollout", "logprob", "update")


def _time_split(metrics: dict[str, float]) -> str | None:
    if "perf/step_seconds" not in metrics:
        return None
    split = " + ".join(
        f"{name} {metrics[f'perf/{name}_seconds']:.2f}"
        for name in _STAGES
        if f"perf/{name}_seconds" in metrics
    )
    total = f"{metrics['perf/step_seconds']:.2f}s"
    return f"{total} = {split}" if split else total


def write_resolved_config(cfg: LoggingConfig, resolved: dict[str, Any]) -> Path:
    """Print the resolved config and save it as ``logging.dir/config.yaml``."""
    text = yaml.safe_dump(resolved, sort_keys=False)
    print("resolved config:\n" + text, flush=True)
    path = Path(cfg.dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _tensorboard_writer(log_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(
            "logging.tensorboard_dir is set but the 'tensorboard' package is not installed "
            "(pip install tensorboard, or set logging.tensorboard_dir: null)"
        ) from e
    return SummaryWriter(log_dir=log_dir)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines of steps > ``last_step`` (a resumed run re-logs the steps after its
    checkpoint). A torn last line (the writer was killed mid-line) is dropped with a warning;
    any other unreadable line is an error naming the file and line. Written aside, then renamed,
    so a crash here cannot lose the lines kept."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    keep = []
    for lineno, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError) as e:
            if lineno == len(lines):
                print(f"warning: {path}:{lineno}: dropped a torn last line", file=sys.stderr)
                break
            raise ValueError(f"{path}:{lineno}: not a metrics line ({e})") from e
        if step <= last_step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)


class Monitor:
    """Writes one JSON line per step (``{"step": N, "<metric>": value, ...}``), an optional
    TensorBoard scalar per metric, and a progress line. Only on the logging rank."""

    def __init__(self, cfg: LoggingConfig, total_steps: int, enabled: bool) -> None:
        self.cfg = cfg
        self.total = total_steps
        self.enabled = enabled
        self.tb = None
        if enabled:
            cfg.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            if cfg.tensorboard_dir:
                self.tb = _tensorboard_writer(cfg.tensorboard_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """``step`` counts completed steps (1-based)."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with open(self.cfg.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
        if self.cfg.progress_bar:
            self._progress(step, metrics)

    def _progress(self, step: int, metrics: dict[str, float]) -> None:
        done = int(20 * step / self.total)
        parts = [f"[{'#' * done}{'.' * (20 - done)}] step {step}/{self.total}"]
        for label, key, fmt in _PROGRESS:
            if key in metrics:
                parts.append(f"{label} {metrics[key]:{fmt}}")
        split = _time_split(metrics)
        if split is not None:
            parts.append(split)
        line = " | ".join(parts)
        if sys.stdout.isatty():
            end = "\n" if step == self.total else ""
            sys.stdout.write("\r" + line + end)
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            print(("\n" if sys.stdout.isatty() else "") + text, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _jsonable(v: float) -> float | None:
    # JSON has no NaN/inf; null marks an undefined mean (e.g. no tokens).
    return v if math.isfinite(v) else None
