"""Triton kernels of megatron-grpo (installed as megatron_grpo.kernels)."""
