"""megatron-grpo: GRPO-family RL training on Megatron-Core."""

__version__ = "0.1.0"
