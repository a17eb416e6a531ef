"""Vocab-parallel log-prob op (torch reference + dispatch to the Triton kernels) and the fused
GRPO path built on it; a call's options are one :class:`LMHeadOptions`, how it runs is its plan
(:mod:`megatron_grpo.ops.lm_head.plan`)."""

from megatron_grpo.ops.lm_head.fused_grpo import fused_grpo_loss, fused_grpo_loss_plan
from megatron_grpo.ops.lm_head.logprobs import logprobs_plan, vocab_parallel_logprobs
from megatron_grpo.ops.lm_head.options import LMHeadOptions
from megatron_grpo.ops.lm_head.plan import (
    DEFAULT_MEMORY_BUDGET,
    HeadShape,
    LMHeadPlan,
    plan_lm_head,
)

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "HeadShape",
    "LMHeadOptions",
    "LMHeadPlan",
    "fused_grpo_loss",
    "fused_grpo_loss_plan",
    "logprobs_plan",
    "plan_lm_head",
    "vocab_parallel_logprobs",
]
