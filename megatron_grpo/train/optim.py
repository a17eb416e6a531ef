"""Megatron's optimizer and LR schedule for the policy, plus the schedule wiring on its config.

``get_megatron_optimizer`` gives ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` or the
``DistributedOptimizer`` (``optimizer.use_distributed_optimizer``; the DDP wrapper must be built
with the same flag). Some of megatron-core's optimizer code creates tensors with
``device="cuda"``; on CUDA-less hosts it runs under ``megatron.parallel.cuda_compat``.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_grpo.megatron.model.build import unwrap
from megatron_grpo.megatron.parallel import cuda_compat
from megatron_grpo.train.config import OptimizerConfig
from megatron_grpo.train.optimizer_memory import release_before_first_step


def mcore_optimizer_config(cfg: OptimizerConfig, params_dtype: torch.dtype) -> McoreOptimizerConfig:
    """megatron-core's ``OptimizerConfig`` from ours (same field names)."""
    return McoreOptimizerConfig(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        sgd_momentum=cfg.sgd_momentum,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )


def build_optimizer(cfg: OptimizerConfig, chunks: list[torch.nn.Module], total_steps: int) -> tuple:
    """``(MegatronOptimizer, OptimizerParamScheduler)`` for DDP-wrapped ``chunks``.

    ``total_steps`` = optimizer steps of the run (the default decay horizon).
    """
    params_dtype = unwrap(chunks[0]).config.params_dtype
    with cuda_compat():
        optimizer = get_megatron_optimizer(mcore_optimizer_config(cfg, params_dtype), chunks)
    decay = cfg.lr_decay_steps or total_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=max(decay, cfg.lr_warmup_steps + 1),
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=max(decay, 1),
        wd_incr_style="constant",
    )
    wire_schedule(chunks, optimizer)
    return optimizer, scheduler


def wire_schedule(chunks: list[torch.nn.Module], optimizer) -> None:
    """Give megatron-core's schedules the optimizer's loss scale. Gradient finalization and DDP's
    no-sync are wired by ``megatron.model.build_model``."""
    unwrap(chunks[0]).config.grad_scale_func = optimizer.scale_loss


@torch.no_grad()
def optimizer_step(optimizer, scheduler) -> tuple[bool, float | None]:
    """One Megatron optimizer step (clip, step, LR schedule); ``(updated, grad_norm)``. The
    first one creates the optimizer state in segments of its own (``optimizer_memory``)."""
    release_before_first_step(optimizer)
    with cuda_compat():
        updated, grad_norm, _ = optimizer.step()
    if updated:
        scheduler.step(increment=1)
    return bool(updated), None if grad_norm is None else float(grad_norm)


def zero_grads(chunks: list[torch.nn.Module], optimizer) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    optimizer.zero_grad()
