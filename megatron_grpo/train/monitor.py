"""Run outputs on the logging rank: resolved config, JSONL metrics, progress line, TensorBoard."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from megatron_grpo.warning_log import WarningLog  # noqa: F401 - re-exported (train.__main__)

if TYPE_CHECKING:  # not imported at run time: the config imports megatron-core (see WarningLog)
    from megatron_grpo.train.config import LoggingConfig, TrainConfig

# (label, metric key, format) of the progress line, in display order.
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
STAGE_KEYS = tuple(f"perf/{name}_seconds" for name in _STAGES)
# Fields a narrow terminal drops, first dropped first; step, reward and the step time stay.
_DROP_ORDER = ("bar", "train tok/s", "gen tok/s", "clip", "kl", "split", "loss")


def _time_split(metrics: dict[str, float]) -> str | None:
    if "perf/step_seconds" not in metrics:
        return None
    split = _split_text(metrics)
    total = f"{metrics['perf/step_seconds']:.2f}s"
    return f"{total} = {split}" if split else total


def _split_text(metrics: dict[str, float]) -> str:
    return " + ".join(
        f"{name} {metrics[f'perf/{name}_seconds']:.2f}"
        for name in _STAGES
        if f"perf/{name}_seconds" in metrics
    )


def progress_line(step: int, total: int, metrics: dict[str, float], width: int | None) -> str:
    """The progress line of ``step`` of ``total``. With a ``width`` (the terminal's columns) the
    line is at most ``width - 1`` characters (so a redrawn line never wraps): fields are dropped
    in ``_DROP_ORDER`` (the bar and throughputs first; step, reward and step time last), and a
    line still too long is cut."""
    done = int(20 * step / max(total, 1))
    fields: dict[str, str] = {"bar": f"[{'#' * done}{'.' * (20 - done)}]"}
    fields["step"] = f"step {step}/{total}"
    for label, key, fmt in _PROGRESS:
        if key in metrics:
            fields[label] = f"{label} {metrics[key]:{fmt}}"
    if "perf/step_seconds" in metrics:
        fields["time"] = f"{metrics['perf/step_seconds']:.2f}s"
        if split := _split_text(metrics):
            fields["split"] = split

    def render(keep: dict[str, str]) -> str:
        head = " ".join(keep[k] for k in ("bar", "step") if k in keep)
        parts = [head, *(v for k, v in keep.items() if k not in ("bar", "step", "time", "split"))]
        if "time" in keep:
            parts.append(keep["time"] + (f" = {keep['split']}" if "split" in keep else ""))
        return " | ".join(parts)

    line = render(fields)
    if width is None:
        return line
    limit = max(width - 1, 1)
    for name in _DROP_ORDER:
        if len(line) <= limit:
            break
        fields.pop(name, None)
        line = render(fields)
    return line[:limit]


def write_resolved_config(
    cfg: TrainConfig, resolved: dict[str, Any], dp_size: int, write: bool = True
) -> Path:
    """Save the resolved config as ``logging.dir/config.yaml`` (unless ``write`` is False: a
    finished run's file stays) and print a short summary of it (:func:`config_summary`)."""
    path = Path(cfg.logging.dir) / "config.yaml"
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(resolved, sort_keys=False))
    print(config_summary(cfg, dp_size, path), flush=True)
    return path


def config_summary(cfg: TrainConfig, dp_size: int, path: Path | str) -> str:
    """A few lines: model, layout, task, steps and where the outputs go (the whole resolved
    config is in ``path``)."""
    m, par, r, t = cfg.model, cfg.parallel, cfg.rollout, cfg.training
    size = _param_count(cfg)
    model = f"{m.num_layers} layers, hidden {m.hidden_size}"
    if m.num_moe_experts:
        model += f", {m.num_moe_experts} experts (top-{m.moe_router_topk})"
    if size is not None:
        model = f"{size / 1e6:.1f}M parameters, " + model
    layout = (
        f"TP {par.tensor_model_parallel_size} PP {par.pipeline_model_parallel_size} "
        f"CP {par.context_parallel_size} EP {par.expert_model_parallel_size} DP {dp_size}"
    )
    task = f"rollouts from {r.input_path}" if r.input_path else str(r.task)
    if r.reward_fn:
        task += f", reward {r.reward_fn}"
    steps = (
        f"{t.steps} x {r.num_prompts} prompts x {r.group_size} samples, "
        f"{t.mini_batches_per_step} mini-batch(es) per step"
    )
    lines = [
        f"config: {path} (the resolved config)",
        f"  model:  {model}",
        f"  layout: {layout}",
        f"  task:   {task}",
        f"  steps:  {steps}",
        f"  logs:   {cfg.logging.dir}",
    ]
    if cfg.checkpoint.dir is not None:
        every = cfg.checkpoint.save_interval
        when = f"every {every} steps and after the last" if every else "after the last step"
        lines.append(f"  checkpoints: {cfg.checkpoint.dir} ({when})")
    return "\n".join(lines)


def _param_count(cfg: TrainConfig) -> int | None:
    """The model's parameters (all ranks together), or None where the count fails."""
    try:
        from megatron_grpo.megatron.config import ParallelConfig
        from megatron_grpo.megatron.plan.memory import stage_params

        dense, expert = stage_params(cfg.model, ParallelConfig(), 0)
    except Exception:  # a summary line is not worth failing a run for
        return None
    return dense + expert


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file (an unreadable line is skipped; no file: none)."""
    rows = []
    path = Path(path)
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _num(row: dict[str, Any], key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def results_summary(rows: list[dict[str, Any]]) -> list[str]:
    """End-of-run lines from the metrics rows: reward first -> last and best, the last eval,
    tokens/s and the mean time split of a step."""
    lines = []
    rewards = [(r["step"], v) for r in rows if (v := _num(r, "reward/mean")) is not None]
    if rewards:
        (s0, r0), (s1, r1) = rewards[0], rewards[-1]
        sb, rb = max(rewards, key=lambda x: x[1])
        lines.append(
            f"  reward:      {r0:.3f} (step {s0}) -> {r1:.3f} (step {s1}), "
            f"best {rb:.3f} (step {sb})"
        )
    evals = [r for r in rows if _num(r, "eval/reward_mean") is not None]
    if evals:
        e = evals[-1]
        text = f"reward {e['eval/reward_mean']:.3f}"
        if (p := _num(e, "eval/pass_at_1")) is not None:
            text += f", pass@1 {p:.3f}"
        lines.append(f"  eval:        {text} (step {e['step']})")
    timed = [r for r in rows if _num(r, "perf/step_seconds") is not None]
    if timed:
        means = {}
        for key in ("perf/step_seconds", "perf/tokens_per_s", *STAGE_KEYS):
            vals = [v for r in timed if (v := _num(r, key)) is not None]
            if vals:
                means[key] = sum(vals) / len(vals)
        rate = (
            f"{means['perf/tokens_per_s']:.0f} tokens/s, " if "perf/tokens_per_s" in means else ""
        )
        # means over every logged step (a resumed run's earlier steps too); under 100 columns
        lines.append(f"  speed:       {rate}per step {_time_split(means)}")
    return lines


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
        # Run before the first completed step's row is written (``at_first_step``); rows of
        # step 0 (the evaluation before training) wait with them: until a step completes, the
        # run directory is left as it was (``train/run_outputs.py``).
        self._at_start: list[Callable[[], None]] = []
        self._held: list[dict[str, Any]] = []
        if enabled and cfg.tensorboard_dir:
            self.tb = _tensorboard_writer(cfg.tensorboard_dir)

    def at_first_step(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the first step has completed, before its metrics are written."""
        self._at_start.append(fn)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """``step`` counts completed steps (1-based; 0: the evaluation before training)."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
        if step == 0:
            self._held.append(row)
            if line := eval_line(metrics):
                self.message(f"before training: {line}")
            return
        while self._at_start:
            self._at_start.pop(0)()
        self.cfg.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.cfg.metrics_path, "a", encoding="utf-8") as f:
            for held in [*self._held, row]:
                f.write(json.dumps(held) + "\n")
        self._held = []
        if self.cfg.progress_bar:
            self._progress(step, metrics)

    def _progress(self, step: int, metrics: dict[str, float]) -> None:
        if sys.stdout.isatty():
            # Redrawn in place; fitted to the terminal so it never wraps; \x1b[K clears the rest
            # of a longer previous line.
            width = shutil.get_terminal_size((80, 24)).columns
            line = progress_line(step, self.total, metrics, width)
            end = "\n" if step == self.total else ""
            sys.stdout.write("\r" + line + "\x1b[K" + end)
        else:
            # A log file or pipe: one plain line every ``print_interval`` steps (and the first
            # and last step), in full.
            every = self.cfg.print_interval
            if step != 1 and step != self.total and step % every:
                return
            sys.stdout.write(progress_line(step, self.total, metrics, None) + "\n")
        sys.stdout.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            print(("\n" if sys.stdout.isatty() else "") + text, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def eval_line(metrics: dict[str, float]) -> str | None:
    """``eval reward 0.123, pass@1 0.100`` from an evaluation's metrics (None: there are none)."""
    parts = [
        f"{label} {metrics[key]:.3f}"
        for label, key in (("eval reward", "eval/reward_mean"), ("pass@1", "eval/pass_at_1"))
        if key in metrics and math.isfinite(metrics[key])
    ]
    return ", ".join(parts) or None


def _jsonable(v: float) -> float | None:
    # JSON has no NaN/inf; null marks an undefined mean (e.g. no tokens).
    return v if math.isfinite(v) else None
