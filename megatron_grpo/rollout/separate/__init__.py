"""``rollout.placement: separate``: generation on GPUs of its own, weights streamed after every
update, bounded staleness.

The torchrun world splits in two (``world``): trainer ranks (the first ones) train with the
recipe's ``parallel`` layout, generation ranks (``rollout.separate.generation_ranks``, the last
ones) run replicas of ``rollout.separate.tensor_model_parallel_size`` that generate and score
continuously (``generation``). Step ``s``'s rollouts are made with the weights of policy version
``max(start, s - max_staleness)`` (``channel.unit_version``), so generation of the next steps
overlaps the trainer's update and every token lags at most ``max_staleness`` versions; tokens
carry their version and behaviour log-prob, and the decoupled IS correction
(``loss.is_correction_level``) uses them. After each update the trainer streams its weights
(``rollout/weight_sync``) and the generators swap them in between units
(``trainer_source.SeparateRollouts.push``).
"""

from megatron_grpo.rollout.separate.channel import Start, Unit, replica_of, unit_version
from megatron_grpo.rollout.separate.generation import STOP, GenerationLoop
from megatron_grpo.rollout.separate.trainer_source import (
    SeparateRollouts,
    drop_stale,
    separate_source,
)
from megatron_grpo.rollout.separate.world import (
    SeparateWorld,
    current_world,
    reset_world,
    split_world,
)

__all__ = [
    "STOP",
    "GenerationLoop",
    "SeparateRollouts",
    "SeparateWorld",
    "Start",
    "Unit",
    "current_world",
    "drop_stale",
    "replica_of",
    "reset_world",
    "separate_source",
    "split_world",
    "unit_version",
]
