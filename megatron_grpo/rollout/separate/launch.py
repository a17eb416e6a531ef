"""Where a rank runs under ``rollout.placement``: ``colocated`` (every rank trains and generates)
or ``separate`` (the world splits into trainer and generation ranks before megatron-core's
parallel state is built). These take the run's root config (``TrainConfig``: its ``rollout``,
``parallel``, ``model`` and ``training`` sections), as the entry point holds it.

``python -m megatron_grpo.train`` calls :func:`run_generation_rank` first: on a generation rank
it runs the generation loop to the end of the run and returns how the run ended ("finished",
or "stopped": the trainer stopped early on a stop request, and the rank exits with the stop's
exit code as the trainer ranks do); on a trainer rank (or colocated) it returns None and the
:class:`~megatron_grpo.train.trainer.Trainer` runs.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from megatron_grpo.config import ConfigError
from megatron_grpo.megatron.parallel import _init_process_group
from megatron_grpo.rollout.separate.generation import STOPPED, GenerationLoop
from megatron_grpo.rollout.separate.world import SeparateWorld, current_world, split_world


def trainer_world_size(cfg, world: int) -> int:
    """The ranks that train: ``world`` less the generation ranks (ConfigError naming the
    field when the split cannot work)."""
    if cfg.rollout.placement != "separate":
        return world
    try:
        gen = cfg.rollout.separate.ranks(world)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    trainers = world - len(gen)
    par = cfg.parallel
    etp = par.expert_tensor_parallel_size or par.tensor_model_parallel_size
    need = math.lcm(par.model_parallel_size, etp * par.expert_model_parallel_size)
    if trainers % need:
        raise ConfigError(
            f"rollout.separate.generation_ranks leaves {trainers} trainer rank(s) of {world}, "
            f"not a multiple of the {need} ranks of one replica of the parallel layout"
        )
    dp = trainers // par.model_parallel_size
    if cfg.rollout.num_prompts % dp:
        raise ConfigError(
            f"rollout.num_prompts={cfg.rollout.num_prompts} must be divisible by the trainer's "
            f"data-parallel size {dp} ({trainers} trainer ranks)"
        )
    return trainers


def split_for(cfg) -> SeparateWorld | None:
    """The split world of a separate run (made once, a collective), None when colocated."""
    if cfg.rollout.placement != "separate":
        return None
    if (world := current_world()) is not None:  # split already (the world is a role's now)
        return world
    _init_process_group(30)  # initialize_parallel's default timeout
    world = dist.get_world_size()
    trainer_world_size(cfg, world)
    s = cfg.rollout.separate
    return split_world(s.ranks(world), s.tensor_model_parallel_size)


def run_generation_rank(cfg, task=None) -> str | None:
    """On a generation rank of a separate run: generate until the trainer stops; "finished"
    (the run's end) or "stopped" (the trainer stopped early on a stop request). None on trainer
    ranks and in colocated runs. ``task``: built and checked already (``train/check.py``), else
    built here."""
    world = split_for(cfg)
    if world is None or not world.is_generator:
        return None
    ctx = cfg.rollout_context()
    loop = GenerationLoop(cfg.model, cfg.rollout, ctx, world, task, cfg.evaluation)
    loop.run()
    return "stopped" if loop.version == STOPPED else "finished"
