"""A unit split over the generation replicas: each generates some of its prompt groups.

Unit ``(step, d)`` (one trainer DP rank's rollouts of a step) is cut into
``channel.part_ranges`` of consecutive prompt groups, one per replica (at most one per group), so
all replicas work on every step even when the trainer has one DP rank. A part is generated
exactly as the colocated run's engine call would generate those samples: the uniforms of the
whole unit are drawn from the colocated run's generator and each sample keeps its own row
(``engine/requests.py``), so which replica makes a sample does not change its tokens (up to the
engine's batch-size-dependent kernels on GPU).
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.engine.requests import Request
from megatron_grpo.rollout.source import GeneratedRollouts


class VersionsEnded(Exception):
    """The trainer's end (``STOP`` / ``STOPPED``) arrived by an in-flight swap: the part being
    generated is abandoned (the trainer no longer waits for it)."""


class InFlight(Protocol):
    """``rollout.separate.in_flight_updates``: the replica's weights, swapped between engine
    steps (``GenerationLoop``)."""

    version: int  # the version the replica holds: new tokens are tagged with it

    def ready(self, finished: torch.Tensor) -> bool:
        """Whether a newer version is complete on every rank of the replica (an engine
        ``stop``: the engine pauses its requests between steps)."""
        ...

    def swap(self) -> None:
        """Copy the complete version in (``VersionsEnded`` when it is the trainer's end)."""
        ...


@torch.no_grad()
def generate_part(
    gen: GeneratedRollouts,
    step: int,
    dp_rank: int,
    lo: int,
    hi: int,
    version: int,
    round: int = 0,
    flight: InFlight | None = None,
) -> RolloutBatch:
    """Groups ``[lo, hi)`` of unit ``(step, dp_rank)`` (``round`` >= 1: of that extra round's
    fresh prompts, dynamic sampling), scored, every token tagged ``version``; the whole unit
    (``lo == 0``, ``hi`` = all) is ``GeneratedRollouts.next``'s own call. With ``flight`` the
    requests continue across the versions it swaps in (:func:`run_in_flight`), each token
    tagged with its own."""
    gen.dp_rank = dp_rank  # the colocated run's prompts and sampling generator of rank d
    if flight is None and lo == 0 and hi == gen.per_rank:
        batch = gen.next(step, round)
        batch.policy_versions = [[version] * len(r) for r in batch.response_ids]
        return batch
    if gen.engine is None:
        raise ValueError(
            "rollout.placement: separate with several generation replicas per trainer DP rank "
            "needs rollout.engine.kind: kv_cache (it generates slices of a step's prompts)"
        )
    start, prompts = gen.step_prompts(step, round)
    size = gen.cfg.group_size
    uniforms = torch.rand(
        len(prompts) * size, gen.params.max_new_tokens, generator=gen.generator(step, round)
    )
    picked = prompts[lo:hi]
    rows = uniforms[lo * size : hi * size]
    expanded = [p for p in picked for _ in range(size)]
    reqs = [Request(list(p.ids), u, p.max_new_tokens) for p, u in zip(expanded, rows, strict=True)]
    if flight is None:
        gen.engine.run_requests(reqs, gen.params, version, record_routes=gen.record_routes)
    else:
        run_in_flight(gen, reqs, flight)
    group_ids = [start + lo + i for i in range(len(picked)) for _ in range(size)]
    return gen.scored_batch(
        expanded,
        [r.tokens for r in reqs],
        group_ids,
        [r.logprobs for r in reqs],
        [r.routes for r in reqs] if gen.record_routes else None,
        [r.versions for r in reqs],
    )


# Decode steps at most between two checks for a newer version (the engine also checks when a
# row finishes): a swap waits at most this long; each check costs one step's host round trip.
CHECK_EVERY = 16


def run_in_flight(gen: GeneratedRollouts, reqs: list[Request], flight: InFlight) -> None:
    """Run ``reqs`` to their ends, pausing between engine steps whenever ``flight`` has a newer
    version complete: it is swapped in and the unfinished requests continue under it (their KV
    recomputed from their tokens under the new weights; each token keeps its own version)."""
    pending = reqs
    while pending:
        gen.engine.run_requests(
            pending,
            gen.params,
            flight.version,
            stop=flight.ready,
            record_routes=gen.record_routes,
            check_every=CHECK_EVERY,
        )
        pending = [r for r in pending if not r.finished]
        if pending:  # paused: a newer version is complete
            flight.swap()


class PartRounds:
    """Part ``[lo, hi)`` of unit ``(step, dp_rank)`` as dynamic sampling's ``RoundSource``:
    round 0 is the part itself; extra round ``r`` takes ``count`` of that round's fresh prompts
    from position ``lo`` on, so replicas never draw one another's (a replica filters its part
    alone: ``FilteredRollouts(..., local=True)``)."""

    generated = True

    def __init__(
        self,
        gen: GeneratedRollouts,
        dp_rank: int,
        lo: int,
        hi: int,
        version: int,
        flight: InFlight | None = None,
    ) -> None:
        self.gen, self.dp_rank, self.lo, self.hi, self.version = gen, dp_rank, lo, hi, version
        self.flight = flight

    def next(self, step: int, round: int = 0, count: int | None = None) -> RolloutBatch:
        hi = self.hi if count is None else self.lo + count
        version = self.version if self.flight is None else self.flight.version
        return generate_part(self.gen, step, self.dp_rank, self.lo, hi, version, round, self.flight)

    def metrics(self) -> dict[str, float]:
        return self.gen.metrics()
