"""Where generation runs: ``rollout.placement`` and its sections (``colocated``, ``separate``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_grpo.config import check_positive

Placement = Literal["colocated", "separate"]


@dataclass
class SeparateConfig:
    """``rollout.placement: separate``: generation on ranks of its own (``rollout/separate/``).

    Attributes:
        generation_ranks: the ranks of the torchrun world that only generate: the last N
            ranks (an int N, or the list of them); the others train with ``parallel``.
        tensor_model_parallel_size: TP of each generation replica (replicas =
            generation ranks / TP).
        max_staleness: policy versions a trained token may lag the weights it is trained
            under: step ``s`` trains on rollouts generated with the weights of step
            ``max(start, s - max_staleness)``; 0 = the trainer waits for rollouts of its latest
            weights (synchronous). Groups that would lag more are dropped and counted.
        in_flight_updates: a replica swaps in a newer version as soon as it is complete,
            between engine steps, instead of at the next part: its unfinished requests continue
            under the new weights (their KV recomputed), each token tagged with the version
            that sampled it. Tokens only get fresher (lag <= max_staleness still); which tokens
            are newer depends on timing, so runs are not bit-reproducible. Needs
            ``engine.kind: kv_cache`` and ``max_staleness >= 1`` (at 0 no newer version exists
            mid-unit); decode graphs stay valid (weights are copied in place).
    """

    generation_ranks: int | list[int] = 1
    tensor_model_parallel_size: int = 1
    max_staleness: int = 1
    in_flight_updates: bool = False

    def __post_init__(self) -> None:
        g = self.generation_ranks
        if isinstance(g, list):
            if not g or len(set(g)) != len(g) or min(g) < 0:
                raise ValueError(
                    f"generation_ranks must be distinct ranks >= 0 (or a count), got {g}"
                )
        elif isinstance(g, bool) or g < 1:
            raise ValueError(f"generation_ranks must be >= 1 ranks, got {g!r}")
        check_positive(self, "tensor_model_parallel_size")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.count % self.tensor_model_parallel_size:
            raise ValueError(
                f"generation_ranks: {self.count} rank(s) do not divide into replicas of "
                f"tensor_model_parallel_size={self.tensor_model_parallel_size}"
            )

    @property
    def count(self) -> int:
        g = self.generation_ranks
        return len(g) if isinstance(g, list) else g

    def ranks(self, world: int) -> list[int]:
        """The generation ranks of a ``world``-rank run (ValueError naming the field)."""
        n = self.count
        if n >= world:
            raise ValueError(
                f"rollout.separate.generation_ranks: {n} generation rank(s) leave no trainer rank "
                f"in a world of {world}"
            )
        tail = list(range(world - n, world))
        g = self.generation_ranks
        if isinstance(g, list) and sorted(g) != tail:
            raise ValueError(
                f"rollout.separate.generation_ranks={g} must be the last {n} ranks of the "
                f"{world}-rank world ({tail}): trainer ranks come first"
            )
        return tail


GENERATION_WEIGHTS = ("shared", "replica")


@dataclass
class ColocatedConfig:
    """``rollout.placement: colocated``: the trainer's ranks generate between updates.

    Attributes:
        weights: which weights the engine decodes with. ``shared`` (default): the trained
            model's own parameters, in the trainer's layout: at TP > 1 every rank of a TP group
            decodes every sample of its model replica through its shards (plus two TP
            collectives a layer; at EP > 1 the MoE layers' dispatch). ``replica``: each rank
            holds a TP = EP = 1 copy of the policy in the model dtype, refreshed from the
            trained shards before every call, and decodes its share of the TP group's samples
            (generation as data parallelism over the TP ranks, no collective per decode step;
            ``rollout/replica.py``). It costs one copy of the model per GPU: for models that
            fit on one GPU beside the training state (the copy's bytes are in the start-up
            line). At TP = EP = 1 each rank holds the whole trained model already: the engine
            decodes on it, with no copy (the start-up line says so). Needs ``source:
            generate``, ``engine.kind: kv_cache``, pipeline and context parallelism 1,
            megatron-core >= 0.15 and the portable spec. With partial rollouts each rank of a
            TP group keeps a stream of its own in flight (``rollout/partial.py``).
    """

    weights: Literal["shared", "replica"] = "shared"

    def __post_init__(self) -> None:
        if self.weights not in GENERATION_WEIGHTS:
            raise ValueError(
                f"weights must be one of {', '.join(GENERATION_WEIGHTS)}, got {self.weights!r}"
            )
