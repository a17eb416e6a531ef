"""megatron_grpo.ops"""
