"""megatron_grpo.megatron"""
