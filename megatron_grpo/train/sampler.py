"""Moved to :mod:`megatron_grpo.rollout`; the old import path re-exports it."""

from megatron_grpo.rollout import SamplingParams, generate, sample

__all__ = ["SamplingParams", "generate", "sample"]
