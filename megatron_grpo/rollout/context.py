"""What a rollout component needs of the run beyond its own recipe section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutContext:
    """Facts of the run that the rollout wing reads from the root config's other sections (built
    once by ``TrainConfig.rollout_context()``), so that its components take their own section
    and this, never the root config.

    Attributes:
        seed: ``training.seed``: the seeds of prompt order, sampling and evaluation.
        steps: ``training.steps``: the groups a file source must hold.
        vocab_size: ``model.vocab_size``: the vocabulary sampled from and checked against.
        max_sequence_length: ``model.max_sequence_length``: the longest sample.
        record_routes: ``model.moe_enable_routing_replay``: record each token's MoE routes.
        model_config: the ``model`` section (a ``ModelConfig``): what a generation replica is
            built from (``rollout.colocated.weights: replica``); None in contexts without one.
    """

    seed: int
    steps: int
    vocab_size: int
    max_sequence_length: int
    record_routes: bool = False
    model_config: object | None = None
