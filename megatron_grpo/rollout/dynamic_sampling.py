"""Dynamic sampling (DAPO): drop groups whose rewards are all equal and generate more.

A group whose rewards are all equal has zero advantage under every estimator, so generating and
training on it costs time and teaches nothing. :class:`FilteredRollouts` wraps a source that can
generate more than one round per step (``next(step, round)``):

* Round 0 is the step's usual prompts. Round r >= 1 draws fresh prompts from a stream disjoint
  from every base round (:func:`extra_round_first_prompt`) and samples with its own seed. A
  step's batch is therefore a pure function of (seed, step, weights), and a resumed run
  reproduces it exactly.
* After each round every DP rank counts its informative groups and the prompts it wants next
  (all of its share with ``round_size: full``, or just enough for its shortfall). The ranks
  all-reduce the largest wish over the DP group, so they all run the same rounds with the same
  shapes and every collective of generation (TP, EP) is matched. The ranks of one TP group hold
  the same samples, so they agree.
* The batch is the rank's first ``num_prompts / DP`` informative groups in generation order.
  When ``max_extra_rounds`` runs out first, the earliest zero-variance groups fill the batch. They
  have zero advantage, so they carry no policy-gradient signal, but every rank keeps its size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from megatron_grpo.megatron.parallel import all_reduce_max, all_reduce_sum
from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.config import MAX_EXTRA_ROUNDS, FilterGroupsConfig, RolloutConfig

# Extra rounds draw prompts from index 2**40 on, far beyond any run's base prompts.
EXTRA_PROMPTS_BASE = 1 << 40

INFORMATIVE, ALL_CORRECT, ALL_WRONG, ALL_PARTIAL = "informative", "correct", "wrong", "partial"


class RoundSource(Protocol):
    """A rollout source that can generate extra rounds of fresh prompts for a step."""

    generated: bool

    def next(self, step: int, round: int = 0, count: int | None = None) -> RolloutBatch:
        """``count`` prompts of this rank (None: its share of ``num_prompts``)."""

    def metrics(self) -> dict[str, float]: ...


def extra_round_first_prompt(
    num_prompts: int, step: int, round: int, dp_rank: int, per_rank: int
) -> int:
    """Index of DP rank ``dp_rank``'s first prompt in extra round ``round`` (>= 1) of ``step``.

    Each step owns a block of ``MAX_EXTRA_ROUNDS`` rounds of ``num_prompts`` prompts, from
    ``EXTRA_PROMPTS_BASE`` on, so extra prompts never repeat a base prompt (or one another)."""
    if not 1 <= round <= MAX_EXTRA_ROUNDS:
        raise ValueError(f"extra round must be in [1, {MAX_EXTRA_ROUNDS}], got {round}")
    block = step * MAX_EXTRA_ROUNDS + round - 1
    return EXTRA_PROMPTS_BASE + block * num_prompts + dp_rank * per_rank


def classify_group(rewards: Sequence[float], loss_tokens: Sequence[int], tolerance: float) -> str:
    """``INFORMATIVE`` when the rewards of the samples with loss tokens spread by more than
    ``tolerance``; otherwise the group has zero variance: ``ALL_CORRECT`` when its mean reward is
    >= 1 (the top of the built-in tasks' [0, 1] scale), ``ALL_WRONG`` when it is <= 0 (both
    within ``tolerance``), ``ALL_PARTIAL`` in between (e.g. every sample half right). A group with
    fewer than two samples that have loss tokens is never informative; with none, it is
    ``ALL_PARTIAL``."""
    counted = [r for r, n in zip(rewards, loss_tokens, strict=True) if n > 0]
    if len(counted) >= 2 and max(counted) - min(counted) > tolerance:
        return INFORMATIVE
    if not counted:
        return ALL_PARTIAL
    mean = sum(counted) / len(counted)
    if mean >= 1.0 - tolerance:
        return ALL_CORRECT
    return ALL_WRONG if mean <= tolerance else ALL_PARTIAL


def split_groups(batch: RolloutBatch) -> list[list[int]]:
    """Sample indices of each group, groups in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(batch.group_ids):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


@dataclass
class Group:
    """One prompt's samples in the round that generated them, with their ``classify_group``."""

    round: int
    indices: list[int]  # positions in that round's batch
    kind: str


def select_groups(groups: list[Group], count: int) -> tuple[list[Group], int]:
    """The first ``count`` informative groups, topped up with the earliest zero-variance ones,
    in generation order; and how many informative groups that is."""
    order = {id(g): i for i, g in enumerate(groups)}
    kept = [g for g in groups if g.kind == INFORMATIVE][:count]
    fill = [g for g in groups if g.kind != INFORMATIVE][: count - len(kept)]
    if len(kept) + len(fill) < count:
        raise ValueError(f"{len(groups)} groups generated, the batch needs {count}")
    return sorted(kept + fill, key=lambda g: order[id(g)]), len(kept)


def merge_round_metrics(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The inner source's metrics over all rounds of a step: counts and seconds add up,
    ``rollout/kv_slots`` is the largest, ``rollout/decode_batch_mean`` / ``_fill`` weigh by
    decode steps."""
    out: dict[str, float] = {}
    for m in rounds:
        for k, v in m.items():
            if k == "rollout/kv_slots":
                out[k] = max(out.get(k, v), v)
            elif k in STEP_WEIGHTED:
                out[k] = out.get(k, 0.0) + v * m.get("rollout/decode_steps", 1.0)
            else:
                out[k] = out.get(k, 0.0) + v
    steps = sum(m.get("rollout/decode_steps", 1.0) for m in rounds)
    for k in STEP_WEIGHTED:
        if k in out:
            out[k] /= max(steps, 1.0)
    return out


STEP_WEIGHTED = ("rollout/decode_batch_mean", "rollout/decode_batch_fill")


class FilteredRollouts:
    """``rollout.filter_groups``: a :class:`RoundSource` whose steps keep informative groups.

    ``metrics()`` sums its counts over the DP group (the same values on every rank):
    ``rollout/filter_rounds`` (generation rounds, 1 = no extra round), ``rollout/groups_generated``,
    the zero-variance groups among them as ``rollout/groups_all_correct`` / ``_all_wrong`` /
    ``_all_partial`` (see :func:`classify_group`) and ``rollout/groups_zero_variance_frac``,
    ``rollout/groups_kept`` (informative groups trained on), ``rollout/groups_filled``
    (zero-variance groups trained on because the rounds ran out), ``rollout/generated_tokens``
    (response tokens of every round) and ``rollout/reward_mean_generated`` (over every generated
    sample: the policy's reward, unbiased by the filter). Plus the inner source's metrics, merged
    over rounds."""

    def __init__(
        self,
        inner: RoundSource,
        cfg: FilterGroupsConfig,
        per_rank: int,
        dp_group: dist.ProcessGroup | None = None,
        local: bool = False,
    ) -> None:
        """``local``: decide and count for this rank's groups alone, no collective (a separate
        placement's generation replica filtering its part of a unit; its trainer sums the
        :attr:`counts` of every part and DP rank)."""
        self.inner, self.cfg, self.per_rank, self.dp_group = inner, cfg, per_rank, dp_group
        self.local = local
        self.generated = inner.generated
        self._metrics: dict[str, float] = {}
        self.counts: list[float] = []  # the last step's COUNTS (summed over DP unless local)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def next(self, step: int) -> RolloutBatch:
        batches: list[RolloutBatch] = []
        groups: list[Group] = []
        inner_metrics: list[dict[str, float]] = []
        count = self.per_rank  # prompts of this round on this rank
        while count:
            batch = self.inner.next(step, len(batches), count)
            if batch.rewards is None:
                raise ValueError(f"{type(self.inner).__name__}.next returned unscored rollouts")
            groups += self._groups(batch, len(batches))
            batches.append(batch)
            inner_metrics.append(self.inner.metrics())
            count = self._next_round_size(len(batches) - 1, groups)
        chosen, kept = select_groups(groups, self.per_rank)
        picks = [
            [i for g in chosen if g.round == r for i in g.indices] for r in range(len(batches))
        ]
        out = RolloutBatch.concat([b.select(idx) for b, idx in zip(batches, picks, strict=True)])
        local = self._local_counts(batches, groups, kept)
        self.counts = local if self.local else all_reduce_sum(local, self.dp_group)
        filtered = filter_metrics(self.counts, len(batches))
        self._metrics = {**merge_round_metrics(inner_metrics), **filtered}
        return out

    def _groups(self, batch: RolloutBatch, round: int) -> list[Group]:
        tol = self.cfg.reward_tolerance
        rewards, responses = batch.rewards or [], batch.response_ids
        return [
            Group(
                round,
                idx,
                classify_group([rewards[i] for i in idx], [len(responses[i]) for i in idx], tol),
            )
            for idx in split_groups(batch)
        ]

    def _next_round_size(self, last: int, groups: list[Group]) -> int:
        """Prompts per rank of the next round, 0 = none: the most any DP rank asks for, so every
        rank runs the same rounds with the same shapes (the cap needs no collective: every
        rank ran ``last + 1`` rounds)."""
        if last >= self.cfg.max_extra_rounds:
            return 0
        informative = sum(g.kind == INFORMATIVE for g in groups)
        short = max(self.per_rank - informative, 0)
        if short == 0:
            want = 0
        elif self.cfg.round_size == "full" or informative == 0:
            want = self.per_rank
        else:  # the prompts that yield ``short`` informative groups at this step's rate so far
            want = min(self.per_rank, math.ceil(short * len(groups) / informative))
        if self.local:
            return want
        return int(all_reduce_max([float(want)], self.dp_group)[0])

    def _local_counts(
        self, batches: list[RolloutBatch], groups: list[Group], kept: int
    ) -> list[float]:
        """This rank's :data:`COUNTS` of the step."""
        kinds = [g.kind for g in groups]
        local = [
            len(groups),
            kinds.count(ALL_CORRECT),
            kinds.count(ALL_WRONG),
            kinds.count(ALL_PARTIAL),
            kept,
            self.per_rank - kept,
            sum(len(r) for b in batches for r in b.response_ids),
            sum(sum(b.rewards or []) for b in batches),
            sum(len(b) for b in batches),
        ]
        return [float(x) for x in local]


# What a step of dynamic sampling counts, summed over ranks (and a unit's parts) before
# :func:`filter_metrics` turns the sums into metrics.
COUNTS = tuple(
    "groups_generated groups_all_correct groups_all_wrong groups_all_partial groups_kept "
    "groups_filled generated_tokens reward_sum samples".split()
)


def filter_metrics(counts: Sequence[float], rounds: int | float) -> dict[str, float]:
    """The ``rollout/`` metrics of :class:`FilteredRollouts` from summed :data:`COUNTS`."""
    c = dict(zip(COUNTS, counts, strict=True))
    zero = c["groups_all_correct"] + c["groups_all_wrong"] + c["groups_all_partial"]
    out = {f"rollout/{k}": v for k, v in c.items() if k not in ("reward_sum", "samples")}
    out["rollout/filter_rounds"] = float(rounds)
    out["rollout/groups_zero_variance_frac"] = zero / max(c["groups_generated"], 1.0)
    out["rollout/reward_mean_generated"] = c["reward_sum"] / max(c["samples"], 1.0)
    return out


def maybe_filter(
    cfg: RolloutConfig, source: RoundSource, dp_size: int, dp_group: dist.ProcessGroup | None
) -> RoundSource | FilteredRollouts:
    """``source`` wrapped in :class:`FilteredRollouts` when ``rollout.filter_groups.enabled``."""
    f = cfg.filter_groups
    if not f.enabled:
        return source
    return FilteredRollouts(source, f, cfg.num_prompts // dp_size, dp_group)
