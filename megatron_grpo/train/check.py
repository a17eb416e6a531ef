"""``python -m megatron_grpo.train --config F [--set a.b=value ...] --check``: a recipe, its data
and its reward checked in seconds, without torchrun, a GPU or megatron-core.

It reports every mistake at once, then exits 2, or prints a one-screen summary and exits 0:

1. the config: every unknown key (with the closest valid one), bad value and failed cross-field
   check of the recipe and its overrides, each led by the recipe's ``FILE:LINE``
   (``load_train_config`` collects them);
2. the files it names: ``rollout.dataset`` / ``rollout.math`` data files and tokenizer
   directory, ``rollout.input_path``, ``checkpoint.load``;
3. the user code it names: ``rollout.reward_fn`` and a ``rollout.source`` class are imported;
4. the data: the task is built as the trainer builds it (every row read, templated, tokenized
   and checked: ``tasks/prompt_checks.py``), which also loads the tokenizer.

Every training run (and ``--dry-run``) runs steps 2-4 first (:func:`check_inputs`) and hands the
task it built to the trainer, so a problem ends the run before torch.distributed, the model or the
run directory is touched.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_grpo.errors import InputError

if TYPE_CHECKING:  # the config's imports are light (no megatron-core); the tasks' too
    from megatron_grpo.rollout.tasks import Task
    from megatron_grpo.train.config import TrainConfig


class InputErrors(InputError):
    """Several problems of a run's inputs; the message lists each on its own line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        if len(problems) == 1:
            super().__init__(problems[0])
        else:
            lines = "\n".join(f"  {p}" for p in problems)
            super().__init__(f"{len(problems)} problems with the run's inputs:\n{lines}")


# The run's large inputs, which often live only on the cluster: a --dry-run made elsewhere notes
# them instead of failing (training and --check stop on them).
ARTIFACTS = ("rollout.input_path", "checkpoint.load")


def missing_paths(cfg: TrainConfig) -> list[str]:
    """One line per file or directory the config names that does not exist (``field: ...``)."""
    r = cfg.rollout
    wanted: list[tuple[str, str, bool]] = []  # (field, path, is a directory)
    if r.input_path is None and r.task == "dataset":
        d = r.dataset
        wanted += [
            (f"rollout.dataset.train_files[{i}]", p, False) for i, p in enumerate(d.train_files)
        ]
        wanted += [(f"rollout.dataset.val_files[{i}]", p, False) for i, p in enumerate(d.val_files)]
        wanted.append(("rollout.dataset.tokenizer_dir", d.tokenizer_dir, True))
    elif r.input_path is None and r.task == "math":
        wanted += [("rollout.math.data_path", r.math.data_path, False)]
        wanted += [("rollout.math.tokenizer_dir", r.math.tokenizer_dir, True)]
    if r.input_path is not None:
        wanted.append(("rollout.input_path", r.input_path, Path(r.input_path).is_dir()))
    if cfg.checkpoint.load is not None:
        wanted.append(("checkpoint.load", cfg.checkpoint.load, True))
    problems = []
    for name, path, is_dir in wanted:
        p = Path(path)
        ok = p.is_dir() if is_dir else p.is_file()
        if not ok:
            what = "directory" if is_dir else "file"
            why = "is not a " + what if p.exists() else f"no such {what}"
            rel = "" if p.is_absolute() else f" (relative to {Path.cwd()})"
            problems.append(f"{name}: {why} {path!r}{rel}")
    return problems


def _user_code(cfg: TrainConfig) -> list[str]:
    """Import ``rollout.reward_fn`` and a ``rollout.source`` class; one line per failure."""
    problems = []
    r = cfg.rollout
    if r.reward_fn is not None:
        from megatron_grpo.rollout.tasks.reward import load_reward_fn

        try:
            load_reward_fn(r.reward_fn)
        except InputError as e:
            problems.append(str(e))
    if r.source not in (None, "generate", "files"):
        from megatron_grpo.rollout.build import source_class  # imports the engine

        try:
            source_class(r.source)
        except InputError as e:
            problems.append(str(e))
    return problems


def build_task(cfg: TrainConfig) -> Task:
    """The task of ``rollout.task`` as the trainer uses it, checked against the model's
    vocabulary (``rollout.source.build_checked_task``, without the engine's imports)."""
    from megatron_grpo.rollout.tasks import build_task as build

    task = build(cfg.rollout, cfg.training.seed)
    vocab = task.tokenizer.vocab_size
    if vocab > cfg.model.vocab_size:
        raise InputError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the task tokenizer's "
            f"vocabulary ({vocab})"
        )
    return task


def needs_task(cfg: TrainConfig) -> bool:
    """Whether the run builds a task: it generates (or evaluates) from the task's prompts."""
    return cfg.rollout.source != "files" or cfg.evaluation.enabled


def check_inputs(cfg: TrainConfig, announce: bool = True, planning: bool = False) -> Task | None:
    """Steps 2-4 of the module docstring for a valid ``cfg``: the task (None when the run reads
    rollout files and does not evaluate). Raises :class:`InputErrors` listing every problem
    found (the data is checked only once its files, tokenizer and reward load). ``announce``:
    print :func:`repeat_warning` (on rank 0). ``planning`` (``--dry-run``): a missing
    :data:`ARTIFACTS` path is one ``note:`` line, not an error."""
    missing = missing_paths(cfg)
    if planning:
        away = [m for m in missing if m.startswith(ARTIFACTS)]
        if away and announce and os.environ.get("RANK", "0") == "0":
            print(f"note: not on this machine (a training run stops on it): {'; '.join(away)}")
        missing = [m for m in missing if m not in away]
    problems = missing + _user_code(cfg)
    if problems:
        raise InputErrors(problems)
    if not needs_task(cfg):
        return None
    task = build_task(cfg)
    line = repeat_warning(cfg, task)
    if announce and line is not None and os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    return task


def repeat_warning(cfg: TrainConfig, task: Any) -> str | None:
    """The start-up warning when a step asks for more prompts than the dataset has (they then
    repeat within a step: several groups of the same prompt), else None."""
    n, want = _size(task), cfg.rollout.num_prompts
    if n is None or n >= want:
        return None
    return (
        f"warning: rollout.num_prompts={want} but the training data has {n} prompts: each step "
        f"uses some of them {-(-want // n)} times (groups of the same prompt); lower "
        "rollout.num_prompts or add data"
    )


def _size(task: Any) -> int | None:
    try:
        return len(task)
    except TypeError:  # an endless task (reverse_digits)
        return None


def summary(cfg: TrainConfig, task: Task | None, path: str, seconds: float) -> str:
    """The one-screen summary of a recipe that passed."""
    m, par, r, t = cfg.model, cfg.parallel, cfg.rollout, cfg.training
    model = f"{m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}"
    if m.num_moe_experts:
        model += f", {m.num_moe_experts} experts (top-{m.moe_router_topk})"
    data = f"rollouts from {r.input_path}" if r.input_path else f"task {r.task}"
    if (n := _size(task)) is not None:
        data += f", {n} training prompts"
    val = getattr(task, "val_prompts", None)
    if callable(val) and (nv := len(val())):
        data += f", {nv} validation prompts"
    layout = (
        f"TP {par.tensor_model_parallel_size} PP {par.pipeline_model_parallel_size} "
        f"CP {par.context_parallel_size} EP {par.expert_model_parallel_size}"
    )
    lines = [
        f"ok: {path} (config, files, reward and data checked in {seconds:.1f} s)",
        f"  model:   {model}" + (f" (from {cfg.checkpoint.load})" if cfg.checkpoint.load else ""),
        f"  layout:  {layout}",
        f"  data:    {data}",
        f"  reward:  {r.reward_fn or 'the task reward'}",
        f"  steps:   {t.steps} x {r.num_prompts} prompts x {r.group_size} samples",
        f"  outputs: {cfg.logging.dir}"
        + (f", checkpoints {cfg.checkpoint.dir}" if cfg.checkpoint.dir else ""),
    ]
    if (line := repeat_warning(cfg, task)) is not None:
        lines.append(line)
    return "\n".join(lines)


def run_check(path: str, overrides: list[str]) -> int:
    """``--check``: 0 and the summary, or 2 and every problem (``config error:`` / ``error:``)."""
    import sys

    from megatron_grpo.config import ConfigError
    from megatron_grpo.train.config import load_train_config

    t0 = time.perf_counter()
    try:
        cfg = load_train_config(path, overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        task = check_inputs(cfg, announce=False)  # the summary shows the warning
    except InputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(summary(cfg, task, path, time.perf_counter() - t0), flush=True)
    return 0
