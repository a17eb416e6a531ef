"""Checks across a recipe's sections that a layout can run what the recipe asks of it, made at
load (``--check`` reports them in seconds, not at a run's start-up): a separate generation
replica, evaluation, and the TP collectives' options against the TP they run at. Each takes the
sections it reads (``TrainConfig.__post_init__`` calls them) and raises ``ValueError`` naming
the fields; the config's loader adds the recipe's FILE:LINE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_grpo.rollout.engine.decode_overlap import why_not as why_not_halves
from megatron_grpo.rollout.engine.tp_all_reduce import KERNELS as TP_REDUCE_KERNELS

if TYPE_CHECKING:
    from megatron_grpo.megatron.config import ModelConfig, ParallelConfig
    from megatron_grpo.rollout.config import EvaluationConfig, RolloutConfig

# rollouts of older policies (partial, separate placement) need the decoupled IS correction
STALE_NEEDS_IS = (
    "trains on tokens of older policy versions: set loss.is_correction_level (token, sequence "
    "or sequence_mean: the decoupled IS correction behaviour -> proximal policy)"
)


def generating_tp(rollout: RolloutConfig, parallel: ParallelConfig) -> int:
    """The TP size the engine decodes at: the separate replica's, 1 on colocated replicas (each
    rank a TP = EP = 1 copy), else the trainer's."""
    if rollout.placement == "separate":
        return rollout.separate.tensor_model_parallel_size
    if rollout.colocated.weights == "replica":
        return 1
    return parallel.tensor_model_parallel_size


def check_tp_collectives(
    parallel: ParallelConfig, model: ModelConfig, rollout: RolloutConfig
) -> None:
    """An explicit option of the TP collectives where it would do nothing or cannot run:
    ``model.layer_kernels.tp_overlap`` ring / symm without sequence parallelism at TP > 1,
    ``rollout.engine.tp_all_reduce`` one_shot / two_shot and ``rollout.engine.decode_overlap:
    halves`` where the engine decodes at TP 1 (and the halves' other limits)."""
    p, overlap = parallel, model.layer_kernels.tp_overlap
    if overlap in ("ring", "symm") and not (
        p.sequence_parallel and p.tensor_model_parallel_size > 1
    ):
        raise ValueError(
            f"model.layer_kernels.tp_overlap: {overlap} overlaps sequence parallelism's "
            f"collectives: it needs parallel.sequence_parallel: true at "
            f"parallel.tensor_model_parallel_size > 1 (here {p.tensor_model_parallel_size}, "
            f"sequence_parallel {str(p.sequence_parallel).lower()}); use auto or off"
        )
    engine, tp = rollout.engine, generating_tp(rollout, parallel)
    if engine.tp_all_reduce in TP_REDUCE_KERNELS and tp == 1:
        raise ValueError(
            f"rollout.engine.tp_all_reduce: {engine.tp_all_reduce} cannot run here: the engine "
            "decodes at TP 1 (nothing to reduce); use auto or nccl"
        )
    if engine.decode_overlap != "halves":
        return
    why = why_not_halves(tp, engine.decode_path, model.num_moe_experts is not None)
    if why:
        raise ValueError(f"rollout.engine.decode_overlap: halves cannot run here: {why}")


def check_separate(
    rollout: RolloutConfig,
    parallel: ParallelConfig,
    model: ModelConfig,
    is_correction_level: str | None,
    offload_during_rollout: bool | str,
) -> None:
    """``rollout.placement: separate``: the layouts a generation replica cannot run
    (``is_correction_level``: ``loss.``'s; ``offload_during_rollout``: ``training.``'s)."""
    if rollout.placement != "separate":
        return
    s, p = rollout.separate, parallel
    if s.max_staleness > 0 and is_correction_level is None:
        raise ValueError(f"rollout.separate.max_staleness={s.max_staleness} {STALE_NEEDS_IS}")
    if p.pipeline_model_parallel_size > 1 or p.context_parallel_size > 1:
        raise ValueError(
            "rollout.placement: separate streams the weights from a trainer with "
            "parallel.pipeline_model_parallel_size = 1 and context_parallel_size = 1"
        )
    tp, groups = s.tensor_model_parallel_size, model.num_query_groups or model.num_attention_heads
    if model.num_attention_heads % tp or groups % tp:
        raise ValueError(
            f"rollout.separate.tensor_model_parallel_size={tp} must divide "
            f"model.num_attention_heads={model.num_attention_heads} and the query groups "
            f"({groups})"
        )
    if offload_during_rollout is True:
        raise ValueError(
            "training.offload_during_rollout: true frees memory for generation, but with "
            "rollout.placement: separate the trainer ranks do not generate (set auto or false)"
        )


def check_evaluation(
    evaluation: EvaluationConfig, rollout: RolloutConfig, parallel: ParallelConfig
) -> None:
    """Evaluation generates with the policy from the dataset task's validation prompts."""
    e, r = evaluation, rollout
    if not e.enabled:
        return
    on = f"evaluation.interval={e.interval}"
    if r.task != "dataset":
        raise ValueError(
            f"{on} evaluates on validation prompts: it needs rollout.task: dataset with "
            f"rollout.dataset.val_files (rollout.task is {r.task!r})"
        )
    if not r.dataset.val_files:
        raise ValueError(
            f"{on} needs validation prompts: rollout.dataset.val_files is empty (or set "
            "evaluation.interval: 0)"
        )
    p = parallel
    if p.pipeline_model_parallel_size > 1 or p.context_parallel_size > 1:
        raise ValueError(
            f"{on} generates with the policy, which needs "
            "parallel.pipeline_model_parallel_size = 1 and parallel.context_parallel_size = 1"
        )
