"""Partial rollouts (``rollout.partial``): the decode batch stays full across steps.

A synchronous step waits for its longest response while the decode batch drains. Here each DP
rank keeps ``num_prompts / DP`` groups plus ``over_provision`` of that in flight; a step ends as
soon as ``num_prompts / DP`` whole groups finished. Unfinished requests pause (their KV rows
recomputed or kept, ``rollout.partial.kv``) and continue in the next step under the updated
weights: the engine decodes with the policy's own weights, so no copy is needed.

Provenance: every response token records the policy version (training step) that sampled it and
its behaviour log-prob (the engine's), in ``RolloutBatch.policy_versions`` / ``rollout_logprobs``.
The loss corrects through the decoupled IS of ``loss.is_correction_level``: behaviour = the
rollout log-probs, proximal = the old-log-prob pass (always run when ``max_staleness`` > 0).
A group is scored only when all its members finished; one whose oldest token would lag more
than ``max_staleness`` versions behind the step that trains on it is dropped and counted.

Determinism (``--resume`` exact): rank ``d``'s ``c``-th prompt is prompt
``(c // n) * num_prompts + d * n + c % n`` (n = ``num_prompts / DP``: the synchronous run's
prompts when nothing is carried); requests admitted in round ``r`` of step ``s`` draw their
uniforms from the synchronous run's generator of ``(seed, s, d, r)``; the groups in flight are
saved with each checkpoint (:meth:`state_dict`).

On replicas (``rollout.colocated.weights: replica``) each rank ``t`` of a TP group is a stream
of its own: it keeps its share ``[lo, hi)`` of the DP rank's ``n`` prompts of each round
(``rollout.replica.share``: its ``c``-th prompt is ``(c // k) * num_prompts + d * n + lo + c %
k``, ``k = hi - lo``) in flight on its own replica, ends its generation when its share of the
step's groups finished, and the TP group's finished groups, gathered in prompt order, are every
rank's batch. Its uniforms come from a generator seeded by ``(seed, s, d, r)`` and the stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.parallel import all_reduce_max, all_reduce_sum
from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.config import RolloutConfig
from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.rollout.engine.requests import Request
from megatron_grpo.rollout.replica import ReplicaEngine, share
from megatron_grpo.rollout.source import GeneratedRollouts, engine_metrics
from megatron_grpo.rollout.tasks import Prompt


@dataclass
class Group:
    """One prompt's ``group_size`` requests; ``order``: its position in the rank's stream."""

    index: int
    order: int
    prompt: Prompt
    requests: list[Request]

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.requests)

    def oldest(self) -> int | None:
        """The oldest policy version among its tokens (None: no token yet)."""
        return min((r.versions[0] for r in self.requests if r.versions), default=None)

    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)


class PartialRollouts:
    """``rollout.partial.enabled``: a rollout source over :class:`GeneratedRollouts`'s task,
    engine and scorer (``inner``, also what evaluation generates with, never partially) whose
    requests outlive a step. ``next(step, round, count)`` is dynamic sampling's interface too:
    an extra round asks the same pool for ``count`` more finished groups."""

    generated = True

    def __init__(
        self,
        inner: GeneratedRollouts,
        cfg: RolloutConfig,
        ctx: RolloutContext,
        layout: ParallelLayout,
    ) -> None:
        if inner.engine is None:
            raise ValueError("rollout.partial.enabled needs rollout.engine.kind: kv_cache")
        self.inner, self.cfg, self.partial = inner, cfg, cfg.partial
        self.record_routes = ctx.record_routes
        self.dp_rank, self.per_dp = layout.dp_rank, cfg.num_prompts // layout.dp_size
        # replicas: this rank's stream of its TP group (else every rank of the group the same)
        replica = isinstance(inner.engine, ReplicaEngine)
        self.stream, self.streams = inner.engine.stream if replica else (0, 1)
        if self.per_dp < self.streams:
            raise ValueError(
                f"rollout.partial on replicas: rollout.num_prompts / DP = {self.per_dp} prompts "
                f"per DP rank cannot feed the {self.streams} streams of a TP group (one each at "
                "least): raise rollout.num_prompts"
            )
        self.lo, hi = share(self.per_dp, self.stream, self.streams)
        self.per_rank = hi - self.lo  # this stream's groups of a step
        self.extra = math.ceil(self.per_rank * self.partial.over_provision)
        self.groups: list[Group] = []  # in flight, oldest first
        self.position = 0  # prompts of this rank's stream admitted so far
        self.dp_group, self.mp_group = layout.dp_group, layout.mp_group
        self._metrics: dict[str, float] = {}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def next(self, step: int, round: int = 0, count: int | None = None) -> RolloutBatch:
        """``count``: finished groups of the DP rank (default: its share of a step)."""
        need = self.per_rank
        if count is not None:  # this stream's share of the DP rank's count
            lo, hi = share(count, self.stream, self.streams)
            need = hi - lo
        self._admit(step, round, need + self.extra)
        self._generate(step, need)
        chosen = self._gathered(self._take(need))
        batch = self._score(chosen)
        carried, dropped = self._carry(step)
        self._agree()
        self._metrics = {**engine_metrics(self.inner.engine.stats), **self._count(carried, dropped)}
        return batch

    # ------------------------------------------------------------------ named steps
    def _admit(self, step: int, round: int, target: int) -> None:
        """Fresh groups up to ``target`` in flight (at least one unfinished one, so that every
        rank of an expert group has requests to run)."""
        new = max(target - len(self.groups), 0)
        if new == 0 and all(g.finished for g in self.groups):
            new = 1
        if new == 0:
            return
        g, m = self.cfg.group_size, self.inner.params.max_new_tokens
        uniforms = torch.rand(new * g, m, generator=self._generator(step, round))
        for j in range(new):
            index = self._prompt_index(self.position)
            [prompt] = self.inner.task.prompts(index, 1)
            self._check_prompt(prompt)
            rows = uniforms[j * g : (j + 1) * g]
            reqs = [Request(list(prompt.ids), u, prompt.max_new_tokens) for u in rows]
            self.groups.append(Group(index, self.position, prompt, reqs))
            self.position += 1

    def _generator(self, step: int, round: int) -> torch.Generator:
        """The synchronous run's generator of ``(seed, step, dp_rank, round)``; on replicas one
        seeded from its first draw and this stream, so the streams draw independent numbers."""
        base = self.inner.generator(step, round)
        if self.streams == 1:
            return base
        seed = int(torch.randint(2**62, (1,), generator=base)) + self.stream
        return torch.Generator().manual_seed(seed)

    def _prompt_index(self, c: int) -> int:
        k = self.per_rank  # this stream's prompts of a round (all the DP rank's: n)
        return (c // k) * self.cfg.num_prompts + self.dp_rank * self.per_dp + self.lo + c % k

    def _check_prompt(self, prompt: Prompt) -> None:
        limit = self.cfg.max_prompt_length
        if len(prompt.ids) > limit:
            raise ValueError(
                f"a prompt has {len(prompt.ids)} tokens > rollout.max_prompt_length={limit}: "
                f"{prompt.text[:80]!r}"
            )

    def _generate(self, step: int, need: int) -> None:
        """Run the unfinished requests (oldest groups first) until ``need`` groups finished."""
        groups = [g for g in self.groups if not g.finished]
        requests = [r for g in groups for r in g.requests if not r.finished]
        owner = [j for j, g in enumerate(groups) for r in g.requests if not r.finished]
        owner = torch.tensor(owner, dtype=torch.long)
        before = torch.tensor([sum(r.finished for r in g.requests) for g in groups])
        ready_before = sum(g.finished for g in self.groups)
        size = self.cfg.group_size

        def stop(finished: torch.Tensor) -> bool:
            done = before.index_add(0, owner, finished.long())
            return ready_before + int((done == size).sum()) >= need

        p = self.partial
        self.inner.engine.run_requests(
            requests,
            self.inner.params,
            step,
            stop,
            keep_kv=p.kv == "keep",
            record_routes=self.record_routes,
        )

    def _take(self, need: int) -> list[Group]:
        """The ``need`` oldest finished groups (stream order: the synchronous run's order)."""
        ready = sorted((g for g in self.groups if g.finished), key=lambda g: g.order)[:need]
        if len(ready) < need:
            raise RuntimeError(f"partial rollouts: {len(ready)} groups finished, {need} needed")
        taken = {id(g) for g in ready}
        self.groups = [g for g in self.groups if id(g) not in taken]
        return ready

    def _gathered(self, groups: list[Group]) -> list[Group]:
        """On replicas: the finished groups of every stream of the TP group, in prompt order
        (every rank's batch); else ``groups``."""
        if self.streams == 1:
            return groups
        parts: list = [None] * self.streams
        dist.all_gather_object(parts, groups, group=self.mp_group)
        return sorted((g for part in parts for g in part), key=lambda g: g.index)

    def _score(self, groups: list[Group]) -> RolloutBatch:
        """The finished groups scored (only now: every member is complete)."""
        size = self.cfg.group_size
        expanded = [g.prompt for g in groups for _ in range(size)]
        reqs = [r for g in groups for r in g.requests]
        group_ids = [g.index for g in groups for _ in range(size)]
        return self.inner.scored_batch(
            expanded,
            [r.tokens for r in reqs],
            group_ids,
            [r.logprobs for r in reqs],
            [r.routes for r in reqs] if self.record_routes else None,
            [r.versions for r in reqs],
        )

    def _carry(self, step: int) -> tuple[int, int]:
        """Drop the groups whose oldest token would lag more than ``max_staleness`` versions
        behind the next step; returns the requests carried (holding tokens) and dropped."""
        keep, dropped = [], 0
        for g in self.groups:
            oldest = g.oldest()
            if oldest is not None and step + 1 - oldest > self.partial.max_staleness:
                dropped += len(g.requests)
            else:
                keep.append(g)
        self.groups = keep
        carried = sum(bool(r.tokens) for g in keep for r in g.requests)
        return carried, dropped

    def _agree(self) -> None:
        """Every rank of a model replica holds the same requests (TP ranks sample the same
        tokens); checked by a fingerprint of what continues, so a divergence fails loudly. On
        replicas each rank holds its own stream's: nothing to check."""
        group = self.mp_group
        if self.streams > 1 or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        fp = float(sum((g.index % 1000003 + 1) * (g.tokens() + 1) for g in self.groups) % 2**50)
        hi, neg_lo = all_reduce_max([fp, -fp], group)
        if hi != -neg_lo:
            raise RuntimeError(
                "partial rollouts: the ranks of a model replica disagree on the requests that "
                "continue (their generations diverged)"
            )

    def _count(self, carried: int, dropped: int) -> dict[str, float]:
        """Over DP, and over the streams of a TP group on replicas (each its own requests)."""
        group = None if self.streams > 1 else self.dp_group  # replicas: PP = CP = 1, the world
        c, d = all_reduce_sum([float(carried), float(dropped)], group)
        return {"rollout/partial_carried": c, "rollout/partial_dropped": d}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """The groups in flight (tokens, versions, behaviour log-probs, uniforms, kept KV rows,
        routes) and the stream position: what ``--resume`` continues from."""
        return {
            "position": self.position,
            "dp_rank": self.dp_rank,
            "stream": (self.stream, self.streams),
            "groups": [
                {"index": g.index, "order": g.order, "requests": [r.state() for r in g.requests]}
                for g in self.groups
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["dp_rank"] != self.dp_rank:
            raise ValueError(f"partial state of DP rank {state['dp_rank']} on rank {self.dp_rank}")
        stream = tuple(state.get("stream", (0, 1)))
        if stream != (self.stream, self.streams):
            raise ValueError(f"partial state of stream {stream} on {(self.stream, self.streams)}")
        self.position = state["position"]
        self.groups = []
        for g in state["groups"]:
            [prompt] = self.inner.task.prompts(g["index"], 1)
            reqs = [Request.from_state(r) for r in g["requests"]]
            self.groups.append(Group(g["index"], g["order"], prompt, reqs))

    def restore(self, state: dict | None, step: int) -> bool:
        """On resume at ``step``: the saved requests in flight (``state``, this rank's
        :meth:`state_dict`) continue; without them (a checkpoint of a run without partial
        rollouts, or of another world size) the stream starts afresh at the synchronous run's
        prompts of ``step``. Returns whether requests were restored."""
        if state is not None:
            self.load_state_dict(state)
            return True
        self.groups, self.position = [], step * self.per_rank
        return False

    def in_flight(self) -> int:
        """Requests in flight (holding tokens)."""
        return sum(bool(r.tokens) for g in self.groups for r in g.requests)


def offpolicy_metrics(batch: RolloutBatch, step: int, group: dist.ProcessGroup) -> dict:
    """``rollout/offpolicy_token_frac`` (response tokens sampled by an older policy version)
    and ``rollout/staleness_max`` (the largest lag, in versions) of the trained batch, over
    DP; empty when the batch carries no ``policy_versions``."""
    if batch.policy_versions is None:
        return {}
    versions = [v for vs in batch.policy_versions for v in vs]
    old = sum(v < step for v in versions)
    lag = max((step - v for v in versions), default=0)
    old, total = all_reduce_sum([float(old), float(len(versions))], group)
    [lag] = all_reduce_max([float(lag)], group)
    return {"rollout/offpolicy_token_frac": old / max(total, 1.0), "rollout/staleness_max": lag}


def partial_source(source: object) -> PartialRollouts | None:
    """The :class:`PartialRollouts` behind ``source`` (through wrappers that keep it as
    ``inner``, e.g. dynamic sampling), or None."""
    while source is not None:
        if isinstance(source, PartialRollouts):
            return source
        source = getattr(source, "inner", None)
    return None
