"""The rollout source of a run, assembled from ``rollout.source`` and its wrappers.

:meth:`RolloutPlan.open` runs before the model is built: rollout files, the task (and so the
validation prompts) and a ``rollout.source`` class are opened and checked then, so a wrong path
or name fails fast. :meth:`RolloutPlan.build` then constructs the source over the policy and
wraps it: :class:`PartialRollouts` (``rollout.partial``), then :class:`FilteredRollouts`
(``rollout.filter_groups``). The trainer only calls ``next(step)`` and ``metrics()`` on the
result; an asynchronous orchestrator takes the place of these wrappers over the same
:class:`GeneratedRollouts`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_grpo.errors import InputError
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.rollout.config import ROLLOUT_SOURCES, RolloutConfig
from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.rollout.dynamic_sampling import maybe_filter
from megatron_grpo.rollout.partial import PartialRollouts
from megatron_grpo.rollout.plugins import load_object
from megatron_grpo.rollout.source import (
    FileRollouts,
    GeneratedRollouts,
    RolloutSource,
    build_checked_task,
)
from megatron_grpo.rollout.tasks import Task

# A user class: ``Class(cfg, task, model, dp_rank, dp_size)`` (``cfg``: the run's root config).
SourceFactory = Callable[[object, Task, torch.nn.Module, int, int], RolloutSource]
_SPEC_FORMS = "generate, files, 'pkg.module:Class' or 'path/to/file.py:Class'"
_PROTOCOL = "the RolloutSource protocol, megatron_grpo/rollout/source.py"


def source_class(spec: str) -> type[GeneratedRollouts] | SourceFactory:
    """What ``rollout.source`` constructs: :class:`GeneratedRollouts` for ``generate``, else
    the class of ``"pkg.module:Class"`` / ``"path/to/file.py:Class"`` (imported now, so a
    wrong name fails before the model is built). ``files`` is :class:`FileRollouts`, opened
    by :meth:`RolloutPlan.open`."""
    if spec == "generate":
        return GeneratedRollouts
    if spec in ROLLOUT_SOURCES:
        raise InputError(f"rollout.source: {spec} is not constructed from a class")
    cls = load_object(spec, "rollout.source", _SPEC_FORMS, kind="class")
    missing = [m for m in ("next", "metrics") if not callable(getattr(cls, m, None))]
    if isinstance(cls, type) and missing:
        raise InputError(
            f"rollout.source {spec!r}: {cls.__name__} has no {' / '.join(missing)} method "
            f"({_PROTOCOL})"
        )
    return cls


def check_source(source: Any, cfg: RolloutConfig) -> RolloutSource:
    """``source`` checked against the protocol (and, with ``rollout.filter_groups``, the
    ``next(step, round, count)`` of dynamic sampling)."""
    what = f"rollout.source {cfg.source!r}"
    missing = [m for m in ("next", "metrics") if not callable(getattr(source, m, None))]
    if not hasattr(source, "generated"):
        missing.append("generated")
    if missing:
        raise InputError(
            f"{what}: {type(source).__name__} lacks {', '.join(missing)} ({_PROTOCOL})"
        )
    if cfg.filter_groups.enabled:
        params = inspect.signature(source.next).parameters
        if not {"round", "count"} <= set(params):
            raise InputError(
                f"{what}: rollout.filter_groups.enabled calls next(step, round, count), but "
                f"{type(source).__name__}.next takes ({', '.join(params)})"
            )
    return source


@dataclass
class RolloutPlan:
    """``rollout.source`` opened before the model: ``files`` (``source: files``), ``task``
    (None when only files are read and nothing evaluates) and ``factory`` (what
    :meth:`build` constructs over the policy; None for files)."""

    cfg: RolloutConfig
    ctx: RolloutContext
    files: FileRollouts | None
    task: Task | None
    factory: type[GeneratedRollouts] | SourceFactory | None

    @classmethod
    def open(
        cls,
        cfg: RolloutConfig,
        ctx: RolloutContext,
        layout: ParallelLayout,
        need_task: bool,
        task: Task | None = None,
    ) -> RolloutPlan:
        """``need_task``: build the task even for ``source: files`` (evaluation needs it);
        ``task``: one built and checked already (``train/check.py``), else built here."""
        if cfg.source == "files":
            files = FileRollouts(cfg, ctx, layout.dp_rank, layout.dp_size)
            if task is None and need_task:
                task = build_checked_task(cfg, ctx)
            return cls(cfg, ctx, files, task, None)
        if task is None:
            task = build_checked_task(cfg, ctx)
        return cls(cfg, ctx, None, task, source_class(cfg.source))

    def build(self, model: torch.nn.Module, layout: ParallelLayout, root: object) -> RolloutSource:
        """The run's source over ``model`` (the unwrapped policy, its first chunk), wrapped for
        partial rollouts and dynamic sampling; ``root``: the config a user class gets."""
        source: Any
        if self.factory is None:
            assert self.files is not None
            source = self.files
        else:
            assert self.task is not None
            dp = (layout.dp_rank, layout.dp_size)
            if self.factory is GeneratedRollouts:
                made = GeneratedRollouts(self.cfg, self.ctx, self.task, model, *dp)
            else:
                made = self.factory(root, self.task, model, *dp)
            source = check_source(made, self.cfg)
        if self.cfg.partial.enabled:  # requests outlive a step (rollout/partial.py)
            source = PartialRollouts(source, self.cfg, self.ctx, layout)
        return maybe_filter(self.cfg, source, layout.dp_size, layout.dp_group)
