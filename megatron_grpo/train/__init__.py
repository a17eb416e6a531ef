"""megatron_grpo.train"""
