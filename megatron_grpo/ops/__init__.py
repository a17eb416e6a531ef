"""Vocab-parallel log-prob op (torch reference + dispatch to the Triton kernels) and the fused
GRPO path built on it."""

from megatron_grpo.ops.fused_grpo import fused_grpo_loss
from megatron_grpo.ops.logprobs import vocab_parallel_logprobs

__all__ = ["fused_grpo_loss", "vocab_parallel_logprobs"]
