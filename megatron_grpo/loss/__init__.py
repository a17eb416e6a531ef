"""megatron_grpo.loss"""
