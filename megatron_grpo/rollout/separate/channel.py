"""What travels between generation and trainer ranks over ``data_group`` (gloo, CPU tensors).

A *unit* is the rollouts of one training step for one trainer data-parallel rank: exactly what
that rank's :class:`~megatron_grpo.rollout.source.GeneratedRollouts` would generate in a
colocated run (the same prompts and sampling generator). Its *parts* (``parts.py``: runs of
prompt groups, one per replica) are generated with the weights of policy version
:func:`unit_version` and sent by each replica's first rank to every trainer rank of DP rank
``d`` (a length, then the pickled payload; tags from the part's index, so nothing can
cross).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.rollout.batch import RolloutBatch


def unit_version(step: int, start: int, max_staleness: int) -> int:
    """The policy version whose weights generate step ``step``'s rollouts: ``step -
    max_staleness`` (never older than the run's (or resume's) first weights, ``start``). A
    fixed schedule, so a run (and its resume) is reproducible; every token lags at most
    ``max_staleness`` versions."""
    return max(start, step - max_staleness)


def part_ranges(groups: int, replicas: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` group ranges of a unit of ``groups`` prompt groups over ``replicas``."""
    n = min(groups, replicas)
    return [(j * groups // n, (j + 1) * groups // n) for j in range(n)]


def replica_of(step: int, dp_rank: int, part: int, dp_size: int, parts: int, replicas: int) -> int:
    """The replica that generates part ``part`` of unit ``(step, dp_rank)``."""
    return ((step * dp_size + dp_rank) * parts + part) % replicas


@dataclass
class Unit:
    """One step's rollouts for one trainer DP rank, and how they were made.

    Attributes:
        step / dp_rank / part: what the unit (or part of it) is for.
        version: the policy version that generated every token (``batch.policy_versions``).
        batch: the scored rollouts.
        metrics: the generator's numbers for it (engine counters, ``perf/generation_seconds``,
            ``perf/generator_idle_seconds``: waiting for weights before it).
        counts: dynamic sampling's ``COUNTS`` of the unit (``rollout.filter_groups``), summed
            over its parts and the trainer's DP ranks into the step's metrics; None without it.
    """

    step: int
    dp_rank: int
    part: int
    version: int
    batch: RolloutBatch
    metrics: dict[str, float] = field(default_factory=dict)
    counts: list[float] | None = None


def _tags(step: int, dp_rank: int, part: int, dp_size: int, parts: int) -> tuple[int, int]:
    u = (step * dp_size + dp_rank) * parts + part
    return 2 * u, 2 * u + 1


def send_unit(
    unit: Unit, dsts: list[int], dp_size: int, parts: int, group: dist.ProcessGroup
) -> list:
    """Post the unit to the global ranks ``dsts`` (non-blocking); returns the works and the
    buffers they read (keep them until the works completed)."""
    return _send(unit, dsts, _tags(unit.step, unit.dp_rank, unit.part, dp_size, parts), group)


def recv_unit(
    key: tuple[int, int, int], dp_size: int, parts: int, src: int, group: dist.ProcessGroup
) -> Unit:
    """Receive part ``key = (step, dp_rank, part)`` from global rank ``src`` (blocking)."""
    unit = _recv(src, _tags(*key, dp_size, parts), group)
    if (unit.step, unit.dp_rank, unit.part) != key:
        raise RuntimeError(
            f"separate placement: expected the rollouts (step, DP rank, part) {key}, got "
            f"{(unit.step, unit.dp_rank, unit.part)}"
        )
    return unit


EVAL_TAGS = 1 << 30  # the evaluations' tags start past every unit's


def send_eval(version: int, result: tuple, dsts: list[int], group: dist.ProcessGroup) -> list:
    """Post the evaluation of policy version ``version`` (``(metrics, summary line)``) to the
    global ranks ``dsts`` (non-blocking; keep what it returns until the works completed)."""
    tags = (EVAL_TAGS + 2 * version, EVAL_TAGS + 2 * version + 1)
    return _send((version, *result), dsts, tags, group)


def recv_eval(version: int, src: int, group: dist.ProcessGroup) -> tuple[dict[str, float], str]:
    """The evaluation of policy version ``version`` from global rank ``src`` (blocking)."""
    got, metrics, line = _recv(src, (EVAL_TAGS + 2 * version, EVAL_TAGS + 2 * version + 1), group)
    if got != version:
        raise RuntimeError(f"separate placement: expected the evaluation {version}, got {got}")
    return metrics, line


def _send(obj: object, dsts: list[int], tags: tuple[int, int], group: dist.ProcessGroup) -> list:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    works: list = []
    for dst in dsts:
        works.append(dist.isend(size, dst, group=group, tag=tags[0]))
        works.append(dist.isend(payload, dst, group=group, tag=tags[1]))
    return [works, size, payload]


def _recv(src: int, tags: tuple[int, int], group: dist.ProcessGroup) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group, tag=tags[0])
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=group, tag=tags[1])
    return pickle.loads(payload.numpy().tobytes())


@dataclass
class Start:
    """The trainer's opening message to the generators (rank 0 broadcasts it).

    Attributes:
        start: the first step this run trains (0, or the resumed checkpoint's step); the
            weights that arrive first are that policy version.
        first_unit_step: the first step whose rollouts the generators make (later than
            ``start`` when the trainer resumed holding in-flight rollouts).
        steps: ``training.steps``.
        dp_size: the trainer's data-parallel size.
        dp_ranks: the trainer DP rank of each trainer (global) rank.
        groups: prompt groups per unit (``num_prompts / dp_size``).
    """

    start: int
    first_unit_step: int
    steps: int
    dp_size: int
    dp_ranks: list[int]
    groups: int

    def ranges(self, replicas: int) -> list[tuple[int, int]]:
        """The group ranges of a unit's parts (``parts.part_ranges``)."""
        return part_ranges(self.groups, replicas)

    def trainers_of(self, dp_rank: int) -> list[int]:
        return [r for r, d in enumerate(self.dp_ranks) if d == dp_rank]


def exchange_start(start: Start | None, group: dist.ProcessGroup) -> Start:
    """Rank 0's :class:`Start` on every rank of ``group`` (a collective; others pass None)."""
    box = [start]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
