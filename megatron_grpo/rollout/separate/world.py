"""The torchrun world of a ``rollout.placement: separate`` run, split into two sub-worlds.

Trainer ranks (the first ``world - len(generation_ranks)`` ranks) and generation ranks (the
last ones) each see a world of their own: the process group of their role becomes the default
process group (``torch.distributed``'s ``_update_default_pg``), so megatron-core's
``initialize_model_parallel``, the checkpoint's barriers, the stop agreement and every other
collective over "the world" run over the ranks of one role, unchanged, and each role builds its
own layout (the trainer the recipe's ``parallel``, a generation replica its own TP). Trainer
ranks come first, so a trainer's rank in its sub-world is its global rank (megatron-core's rank
lists and the weight sender's source are global ranks there).

Three groups span both roles, made before the split over the real world (their ranks are
global ranks): ``sync_group`` (trainer rank 0, the weight sender's source, and every generation
rank: the weight broadcasts), ``notice_group`` (the same ranks, gloo: each version's header,
sent before its buckets: ``weight_sync.receiver``) and ``data_group`` (every rank, gloo: scored
rollouts and the run's start/stop messages, as pickled CPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

SOURCE = 0  # the trainer rank that sends the weights (global rank 0)


@dataclass(frozen=True)
class SeparateWorld:
    """This rank's role and the cross-role groups (ranks: global ranks of the real world).

    Attributes:
        trainer_ranks / generation_ranks: the two roles' global ranks.
        rank: this process's global rank.
        sync_group: ``SOURCE`` and every generation rank (weight broadcasts).
        notice_group: the same ranks, gloo (each version's header).
        data_group: every rank, gloo (rollouts, control messages).
        tp: the tensor-parallel size of each generation replica.
    """

    trainer_ranks: tuple[int, ...]
    generation_ranks: tuple[int, ...]
    rank: int
    sync_group: dist.ProcessGroup
    notice_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    tp: int

    @property
    def is_generator(self) -> bool:
        return self.rank in self.generation_ranks

    @property
    def replicas(self) -> int:
        return len(self.generation_ranks) // self.tp

    def replica_leaders(self) -> list[int]:
        """The global rank that ships each replica's rollouts (its first rank)."""
        return list(self.generation_ranks[:: self.tp])

    @property
    def replica(self) -> int:
        """This generation rank's replica index."""
        return self.generation_ranks.index(self.rank) // self.tp

    @property
    def is_leader(self) -> bool:
        return self.rank in self.replica_leaders()


_WORLD: SeparateWorld | None = None


def split_world(generation_ranks: list[int], tp: int) -> SeparateWorld:
    """Split the initialized torch.distributed world (once; later calls return the same split).

    Every rank calls it with the same arguments (a collective): it creates ``sync_group``,
    ``data_group`` and the two role groups, then makes this rank's role group the default
    process group."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = tuple(sorted(generation_ranks))
    trainers = tuple(r for r in range(world) if r not in gen)
    if not trainers or gen != tuple(range(len(trainers), world)):
        raise ValueError(
            f"rollout.separate.generation_ranks={list(generation_ranks)} must be the last ranks "
            f"of the {world}-rank world, leaving at least one trainer rank"
        )
    sync_group = dist.new_group([SOURCE, *gen])
    notice_group = dist.new_group([SOURCE, *gen], backend="gloo")
    data_group = dist.new_group(list(range(world)), backend="gloo")
    trainer_group = dist.new_group(list(trainers))
    generator_group = dist.new_group(list(gen))
    own = generator_group if rank in gen else trainer_group
    c10d._update_default_pg(own)
    _WORLD = SeparateWorld(trainers, gen, rank, sync_group, notice_group, data_group, tp)
    return _WORLD


def current_world() -> SeparateWorld | None:
    """The split of this process (None: the world is not split)."""
    return _WORLD


def reset_world() -> None:
    """Forget the split (tests that run several placements in one process group)."""
    global _WORLD
    _WORLD = None
