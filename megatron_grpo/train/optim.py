"""Megatron's optimizer and LR schedule for the policy, plus the schedule wiring on its config.

``get_megatron_optimizer`` gives ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` or the
``DistributedOptimizer`` (``optimizer.use_distributed_optimizer``; the DDP wrapper must be built
with the same flag). Some of megatron-core's optimizer code creates tensors with
``device="cuda"``; on CUDA-less hosts it runs under ``megatron.parallel.cuda_compat``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch.overrides import TorchFunctionMode

from megatron_grpo.megatron.model import unwrap
from megatron_grpo.megatron.parallel import cuda_compat
from megatron_grpo.train.config import OptimizerConfig


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
    with optimizer_compat():
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
    """Set the hooks megatron-core's schedules read from the model config (as Megatron-LM
    does): gradient finalization (DP/CP reduction, 1/num_tokens scaling under
    ``calculate_per_token_loss``), the loss scale and DDP's no-sync for accumulation."""
    config = unwrap(chunks[0]).config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    no_sync = [c.no_sync for c in chunks if hasattr(c, "no_sync")]
    if no_sync:
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync


class _CpuTypeNamesAsCuda(TorchFunctionMode):
    """``tensor.type()`` of a CPU tensor reports the CUDA type name: megatron-core's gradient
    clipping asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``, which is the only thing
    keeping it from running on CPU (the arithmetic itself is device-agnostic)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and not args[0].is_cuda:
            return out.replace("torch.", "torch.cuda.", 1)
        return out


@contextlib.contextmanager
def optimizer_compat() -> Iterator[None]:
    """Run megatron-core optimizer code on a CUDA-less host (no-op with CUDA): CUDA factory
    calls land on the CPU and CPU tensors pass its CUDA type-name checks."""
    if torch.cuda.is_available():
        yield
        return
    with cuda_compat(), _CpuTypeNamesAsCuda():
        yield


@torch.no_grad()
def optimizer_step(optimizer, scheduler) -> tuple[bool, float | None]:
    """One Megatron optimizer step (clip, step, LR schedule); ``(updated, grad_norm)``."""
    with optimizer_compat():
        updated, grad_norm, _ = optimizer.step()
    if updated:
        scheduler.step(increment=1)
    return bool(updated), None if grad_norm is None else float(grad_norm)


def zero_grads(chunks: list[torch.nn.Module], optimizer) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    optimizer.zero_grad()
