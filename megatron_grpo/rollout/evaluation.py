"""Validation during training: the ``evaluation:`` section (``EvaluationConfig``).

:class:`Evaluator` is built once by the trainer. Before the first step (logged as step 0),
after every ``evaluation.interval`` steps and after the last step, the policy answers the
validation prompts (``task.val_prompts()``: ``rollout.dataset.val_files``, the first
``max_prompts`` of them):

* Prompts are spread over the DP ranks in contiguous blocks of ``ceil(P / DP)``; a rank with
  fewer repeats a prompt to that count (padding, neither scored nor counted), so every rank
  generates the same number of samples (collectives of expert-parallel generation match).
* Each prompt gets ``n_samples`` responses from the trainer's generation: the same engine as
  the rollouts (the ``GeneratedRollouts`` KV-cached engine when the source has one, so CUDA
  graphs are shared), with its own sampling parameters: ``evaluation.temperature`` (0 = greedy,
  top-k 1; otherwise plain sampling), ``rollout.max_response_length`` and the rollouts' stop ids.
  The generator is seeded by ``(training.seed, "eval", step, DP rank)``.
* Rewards go through the same scoring path as training (:class:`RewardScorer`: the task's
  reward or ``rollout.reward_fn``, scored once per model replica and shared with its TP / CP /
  PP peers; the rollout source's scorer when it has one).
* Sums are all-reduced over the DP group; every rank returns the same metrics.

Metrics (a sample *passes* when its reward is >= :data:`PASS_REWARD`, 1.0):

* ``eval/reward_mean``: the mean reward over all samples;
* ``eval/pass_at_1``: over prompts, the fraction of the prompt's samples that pass (the
  unbiased pass@1 estimate from ``n_samples``);
* ``eval/pass_at_{n}`` (``n_samples`` = n > 1): the fraction of prompts with at least one
  passing sample;
* ``eval/response_length``: the mean response length in tokens (the stop token included);
* the same four per ``data_source``: ``eval/<data_source>/reward_mean``, ... (prompts without a
  ``data_source`` count only in the totals);
* ``perf/eval_seconds``: wall seconds of the evaluation (the slowest rank's).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.parallel import all_reduce_max, all_reduce_sum
from megatron_grpo.rollout.config import EvaluationConfig, RolloutConfig
from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.rollout.engine import KVCacheEngine, SamplingParams, generate
from megatron_grpo.rollout.scoring import RewardScorer
from megatron_grpo.rollout.source import build_engine, generated_rollouts, sampling_params
from megatron_grpo.rollout.tasks.base import Prompt, Task

PASS_REWARD = 1.0  # a sample passes when its reward is >= this
_FIELDS = ("reward", "samples", "length", "pass1", "passn", "prompts")  # summed per group


def eval_sampling_params(cfg: EvaluationConfig, base: SamplingParams) -> SamplingParams:
    """The rollouts' parameters ``base`` (max response length, stop ids) with ``evaluation``'s
    temperature: 0 = greedy (top-k 1), otherwise plain sampling (no top-p / top-k)."""
    t = cfg.temperature
    if t == 0.0:
        return dataclasses.replace(base, temperature=1.0, top_p=1.0, top_k=1)
    return dataclasses.replace(base, temperature=t, top_p=1.0, top_k=0)


def shard(num_prompts: int, dp_rank: int, dp_size: int) -> tuple[range, int]:
    """This DP rank's block of prompt indices and how many padding prompts bring it to
    ``ceil(num_prompts / dp_size)``."""
    per = -(-num_prompts // dp_size)
    lo = min(dp_rank * per, num_prompts)
    hi = min(lo + per, num_prompts)
    return range(lo, hi), per - (hi - lo)


def group_sums(
    prompts: Sequence[Prompt],
    rewards: Sequence[float],
    lengths: Sequence[int],
    n: int,
    sources: Sequence[str],
) -> list[float]:
    """Per group (all prompts, then each of ``sources``), the sums of :data:`_FIELDS` over
    ``prompts`` (sample ``j * n + i`` is prompt ``j``'s ``i``-th response), flattened."""
    index = {name: k for k, name in enumerate(sources, 1)}
    sums = [[0.0] * len(_FIELDS) for _ in range(len(sources) + 1)]
    for j, p in enumerate(prompts):
        rs, ls = rewards[j * n : (j + 1) * n], lengths[j * n : (j + 1) * n]
        passed = sum(r >= PASS_REWARD for r in rs)
        row = [sum(rs), n, sum(ls), passed / n, float(passed > 0), 1.0]
        for g in (0, index.get(p.data_source)):
            if g is not None:
                sums[g] = [a + b for a, b in zip(sums[g], row, strict=True)]
    return [x for s in sums for x in s]


def eval_metrics(totals: Sequence[float], n: int, sources: Sequence[str]) -> dict[str, float]:
    """``eval/...`` metrics of the summed :func:`group_sums` (over all ranks)."""
    out: dict[str, float] = {}
    width = len(_FIELDS)
    for g, name in enumerate(["", *sources]):
        reward, samples, length, pass1, passn, prompts = totals[g * width : (g + 1) * width]
        if not prompts:
            continue
        prefix = f"eval/{name}/" if name else "eval/"
        out[f"{prefix}reward_mean"] = reward / samples
        out[f"{prefix}pass_at_1"] = pass1 / prompts
        if n > 1:
            out[f"{prefix}pass_at_{n}"] = passn / prompts
        out[f"{prefix}response_length"] = length / samples
    return out


def eval_due(step: int, steps: int, interval: int, start: int = 0) -> bool:
    """Whether the weights after ``step`` steps are evaluated in a run that trains steps
    ``start .. steps``: step 0 in a fresh run (``start`` 0; never a resumed run's first),
    every ``interval`` steps after the start, and the last."""
    if step <= start:
        return step == start == 0
    return step <= steps and (step == steps or step % interval == 0)


class Evaluator:
    """Built once, before the model (the validation prompts are checked then); :meth:`attach`
    gives it the policy and the rollout source once they exist. Off (every call a no-op) with
    ``evaluation.interval: 0``.

    The trainer calls :meth:`log_initial` before its first step and merges
    :meth:`after_step` into each step's metrics."""

    def __init__(
        self,
        cfg: EvaluationConfig,
        rollout: RolloutConfig,
        ctx: RolloutContext,
        task: Task | None,
        layout: ParallelLayout,
    ) -> None:
        self.cfg, self.rollout, self.ctx, self.layout = cfg, rollout, ctx, layout
        self.dp_rank, self.dp_size = layout.dp_rank, layout.dp_size
        self.enabled = cfg.enabled
        if not self.enabled:
            return
        val = getattr(task, "val_prompts", None)
        if task is None or val is None:
            raise ValueError(
                "evaluation: the task has no validation prompts (rollout.task: dataset with "
                "rollout.dataset.val_files)"
            )
        prompts = val()
        if not prompts:
            raise ValueError(
                "evaluation: rollout.dataset.val_files has no prompts left (all longer than "
                f"rollout.max_prompt_length={rollout.max_prompt_length}?); set "
                "evaluation.interval: 0 or give other val_files"
            )
        limit = cfg.max_prompts
        self.task = task
        self.prompts: list[Prompt] = prompts[:limit] if limit else prompts
        self.sources = sorted({p.data_source for p in self.prompts if p.data_source})
        stop_ids = getattr(task, "stop_ids", ())
        base = sampling_params(rollout, ctx.vocab_size, task.tokenizer.eos_id, stop_ids)
        self.params = eval_sampling_params(cfg, base)
        self.model: torch.nn.Module | None = None
        self.engine: KVCacheEngine | None = None
        self.scorer: RewardScorer | None = None
        self.monitor: Any = None

    def attach(self, model: torch.nn.Module, source: object, monitor: Any = None) -> None:
        """``model``: the unwrapped policy (first chunk). The engine and scorer of ``source``'s
        :class:`GeneratedRollouts` are shared; otherwise the evaluator builds its own.
        ``monitor``: where a one-line summary of each evaluation is printed."""
        if not self.enabled:
            return
        self.model, self.monitor = model, monitor
        generated = generated_rollouts(source)
        if generated is not None and generated.model is model:
            self.engine, self.scorer = generated.engine, generated.scorer
        else:
            self.engine = build_engine(self.rollout, model)
            self.scorer = RewardScorer(self.task, self.rollout, self.layout)

    # ------------------------------------------------------------------ the trainer's calls
    def log_initial(self, start_step: int, monitor: Any) -> None:
        """Step 0 (before any update) as its own metrics line; nothing on a resumed run."""
        if self.enabled and start_step == 0:
            monitor.log(0, self.evaluate(0))

    def after_step(self, step: int) -> dict[str, float]:
        """The evaluation's metrics after ``step`` (1-based) steps when one is due (every
        ``interval`` steps and after the last step), else ``{}``."""
        if not self.enabled or not eval_due(step, self.ctx.steps, self.cfg.interval):
            return {}
        return self.evaluate(step)

    # ------------------------------------------------------------------ one evaluation
    def evaluate(self, step: int) -> dict[str, float]:
        """Generate, score and reduce (all ranks take part); the metrics on every rank."""
        if self.model is None:
            raise RuntimeError("Evaluator.attach(model, source) was not called")
        t0 = time.perf_counter()
        n = self.cfg.n_samples
        block, pad = shard(len(self.prompts), self.dp_rank, self.dp_size)
        mine = [self.prompts[i] for i in block]
        filler = [self.prompts[block.start if len(block) else 0]] * pad
        samples = [list(p.ids) for p in mine + filler for _ in range(n)]
        engine = self.engine if self.engine is not None else "recompute"
        out = generate(self.model, samples, self.params, self._generator(step), engine=engine)
        responses = out.responses[: len(mine) * n]
        expanded = [p for p in mine for _ in range(n)]
        rewards: list[float] = []
        if expanded:  # the same on every rank of the replica: all score, or none
            indices = [i for i in block for _ in range(n)]
            assert self.scorer is not None
            rewards = self.scorer.score(expanded, responses, indices).rewards
        lengths = [len(r) for r in responses]
        sums = group_sums(mine, rewards, lengths, n, self.sources)
        totals = all_reduce_sum(sums, self.layout.dp_group)
        metrics = eval_metrics(totals, n, self.sources)
        metrics["perf/eval_seconds"] = all_reduce_max([time.perf_counter() - t0])[0]
        if self.monitor is not None:
            self.monitor.message(self.summary(step, metrics))
        return metrics

    def summary(self, step: int, m: dict[str, float]) -> str:
        """The evaluation's one console line."""
        n = self.cfg.n_samples
        passes = f", pass@{n} {m[f'eval/pass_at_{n}']:.3f}" if n > 1 else ""
        return (
            f"eval at step {step}: reward {m['eval/reward_mean']:.3f}, pass@1 "
            f"{m['eval/pass_at_1']:.3f}{passes}, length {m['eval/response_length']:.1f} "
            f"({len(self.prompts)} prompts x {n}, {m['perf/eval_seconds']:.1f} s)"
        )

    def _generator(self, step: int) -> torch.Generator:
        key = f"{self.ctx.seed}/eval/{step}/{self.dp_rank}"
        return torch.Generator().manual_seed(random.Random(key).getrandbits(63))


__all__ = [
    "PASS_REWARD",
    "Evaluator",
    "eval_due",
    "eval_metrics",
    "eval_sampling_params",
    "group_sums",
    "shard",
]
