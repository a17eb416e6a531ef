"""The ``--dry-run`` of the trainer: validate a config's parallel layout against a world size,
print which global ranks form each group (Megatron's default order ``tp-cp-ep-dp-pp``, checked
against megatron-core's own ``RankGenerator``) and the per-rank memory plan
(:mod:`megatron_grpo.megatron.plan.memory`), without GPUs, torch.distributed or a model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, TextIO

from megatron_grpo.megatron.config import ModelConfig, ParallelConfig, check_parallel
from megatron_grpo.megatron.layout import (  # noqa: F401 (orthogonal_groups: a public name)
    EXPERT_GROUPS,
    RankLayout,
    orthogonal_groups,
    rank_layout,
)
from megatron_grpo.megatron.plan.generation import (
    format_generation_plan,
    generation_plan,
    replica_bytes,
)
from megatron_grpo.megatron.plan.memory import GIB, MemoryPlan, format_plan, memory_plan
from megatron_grpo.megatron.plan.recompute import RecomputeChoice, choose_recompute
from megatron_grpo.rollout.weight_sync.sender import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:  # the config module loads the engines; the dry run needs none of them
    from megatron_grpo.train.config import TrainConfig


def _fmt_group(ranks: list[int]) -> str:
    if len(ranks) > 3 and all(b - a == ranks[1] - ranks[0] for a, b in pairwise(ranks)):
        step = ranks[1] - ranks[0]
        return f"{ranks[0]}-{ranks[-1]}" if step == 1 else f"{ranks[0]}..{ranks[-1]}/{step}"
    return ",".join(map(str, ranks))


def format_layout(layout: RankLayout, max_groups: int = 8) -> str:
    """One line per group kind: its size, count and the first ``max_groups`` groups
    (``a-b`` = consecutive ranks, ``a..b/k`` = every k-th rank)."""
    sz = layout.sizes
    lines = [
        "rank layout (order tp-cp-ep-dp-pp): " + " ".join(f"{k}={v}" for k, v in sz.items()),
        f"rank groups: {layout.verified}",
    ]
    trivial = [name for name, groups in layout.groups.items() if len(groups[0]) == 1]
    same = sz["ep"] == 1 and sz["etp"] == sz["tp"]  # expert groups = the dense tp / dp ones
    for name, groups in layout.groups.items():
        if name in trivial or (same and name in EXPERT_GROUPS):
            continue
        shown = " ".join(f"[{_fmt_group(g)}]" for g in groups[:max_groups])
        more = f" ... (+{len(groups) - max_groups} more)" if len(groups) > max_groups else ""
        lines.append(f"  {name:<6} {len(groups)} x {len(groups[0])}: {shown}{more}")
    if trivial:
        lines.append(f"  (groups of one rank: {', '.join(trivial)})")
    if same:
        lines.append("  (expert groups: etp = tp, edp = dp)")
    return "\n".join(lines)


def check_layout(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, world_size: int) -> int:
    """Validate the layout against ``world_size`` (ValueError naming the field); returns DP."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    check_parallel(model_cfg, parallel_cfg, world_size)
    tp = parallel_cfg.tensor_model_parallel_size
    moe = model_cfg.num_moe_experts is not None
    if moe and tp > 1 and not parallel_cfg.sequence_parallel:
        raise ValueError(
            "parallel.sequence_parallel must be true for MoE with tensor_model_parallel_size > 1 "
            "(megatron-core's MoE layer refuses to train without it)"
        )
    return parallel_cfg.data_parallel_size(world_size)


def _separate(train_cfg: TrainConfig, world_size: int) -> tuple[int, str]:
    """``rollout.placement: separate``: the trainer ranks' world size and the generation ranks'
    plan (text); the world and "" otherwise."""
    r = train_cfg.rollout
    if r.placement != "separate":
        return world_size, ""
    s = r.separate
    gen = s.ranks(world_size)  # ValueError naming rollout.separate.generation_ranks
    replicas = len(gen) // s.tensor_model_parallel_size
    trainers = world_size - len(gen)
    dp = train_cfg.parallel.data_parallel_size(trainers)
    groups = r.num_prompts // max(dp, 1)
    samples = -(-groups // min(groups, replicas)) * r.group_size
    plan = generation_plan(
        train_cfg.model,
        s.tensor_model_parallel_size,
        replicas,
        samples,
        r.max_prompt_length + r.max_response_length,
        DEFAULT_BUCKET_BYTES,
    )
    head = (
        f"placement separate: ranks 0-{trainers - 1} train (the layout below, world size "
        f"{{trainer}}), ranks {gen[0]}-{gen[-1]} generate; max_staleness {s.max_staleness}"
    )
    return trainers, head + "\n" + format_generation_plan(plan)


@dataclass(frozen=True)
class DryRun:
    layout: RankLayout
    plan: MemoryPlan
    text: str


def micro_batch_tokens(train_cfg: TrainConfig) -> int:
    """Longest packed micro-batch of a trainer config: ``max_tokens_per_micro_batch`` (a longer
    sample forms its own micro-batch), else ``micro_batch_size`` longest samples."""
    t, r = train_cfg.training, train_cfg.rollout
    longest = r.max_prompt_length + r.max_response_length
    if t.max_tokens_per_micro_batch is not None:
        return max(t.max_tokens_per_micro_batch, longest)
    return t.micro_batch_size * longest


def plan_args(train_cfg: TrainConfig, dp_size: int) -> dict:
    """:func:`memory_plan`'s arguments besides the model and layout for a trainer config: what
    the dry run, ``recompute_granularity: auto`` and the offload decision plan with."""
    training, opt = train_cfg.training, train_cfg.optimizer
    return dict(
        micro_batch_tokens=micro_batch_tokens(train_cfg),
        dp_size=dp_size,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        optimizer=opt.optimizer,
        lm_head=train_cfg.lm_head,
        loss_cfg=train_cfg.loss,
        reference_model=training.use_reference_model,
    )


def resolve_recompute(
    train_cfg: TrainConfig, dp_size: int, device_bytes: float | None
) -> RecomputeChoice:
    """``model.recompute_granularity`` made concrete for this run (``auto``: the memory plan's
    choice for ``device_bytes`` of GPU memory per rank, ``plan/recompute.py``): the model
    config to build, and why."""
    args = plan_args(train_cfg, dp_size)
    return choose_recompute(train_cfg.model, train_cfg.parallel, device_bytes=device_bytes, **args)


def dry_run(
    train_cfg: TrainConfig,
    world_size: int,
    *,
    file: TextIO | None = None,
    device_memory_gib: float | None = None,
) -> DryRun:
    """Validate ``train_cfg`` (the trainer's ``TrainConfig``) for ``world_size`` ranks, print the
    rank layout and the per-rank memory plan; no GPU, no torch.distributed, no model.

    Reads ``model``, ``parallel``, ``loss``, ``rollout`` lengths and ``num_prompts``,
    ``training`` (micro-batching, ``use_reference_model``), ``lm_head`` (the step's
    LMHeadOptions: path, memory budget, chunk size, ...) and
    ``optimizer`` (``optimizer``, ``use_distributed_optimizer``). The LM-head plan (which path
    the last stage runs, e.g. "fused_tiled" for GSPO under "fused", and why) is printed with the
    plan. ``device_memory_gib``: GPU memory per rank for ``recompute_granularity: auto``
    (needed then); the plan is that of the chosen setting, and the choice is printed with it.
    """
    model, par = train_cfg.model, train_cfg.parallel
    world_size, generation = _separate(train_cfg, world_size)
    dp = check_layout(model, par, world_size)
    if train_cfg.rollout.num_prompts % dp:
        raise ValueError(
            f"rollout.num_prompts={train_cfg.rollout.num_prompts} must be divisible "
            f"by the data-parallel size {dp}"
        )
    device = None if device_memory_gib is None else device_memory_gib * GIB
    choice = resolve_recompute(train_cfg, dp, device)
    plan = memory_plan(choice.model, par, **plan_args(train_cfg, dp))
    layout = rank_layout(par, world_size)
    text = f"dry run: world size {world_size}\n{format_layout(layout)}\n{format_plan(plan)}"
    text += f"\nactivation recompute: {choice.reason or choice.label + ' (model config)'}"
    if train_cfg.rollout.colocated.weights == "replica":
        copy = replica_bytes(model) / GIB
        text += (
            f"\ngeneration replica (rollout.colocated.weights: replica): {copy:.2f} GiB per rank"
        )
    if generation:
        text = generation.replace("{trainer}", str(world_size)) + "\n" + text
    print(text, file=file or sys.stdout, flush=True)
    return DryRun(layout, plan, text)
