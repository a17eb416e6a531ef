"""Tasks: the toy ``reverse_digits`` task, the local-JSONL ``math`` task, the ``dataset`` task
(``.jsonl`` / ``.parquet`` in verl's layout, chat templates), reward plug-ins."""

from __future__ import annotations

from megatron_grpo.rollout.config import RolloutConfig
from megatron_grpo.rollout.tasks.base import Prompt, Task, Tokenizer
from megatron_grpo.rollout.tasks.dataset import DatasetTask
from megatron_grpo.rollout.tasks.math import HFTokenizer, MathTask
from megatron_grpo.rollout.tasks.reverse_digits import DigitTokenizer, ReverseDigitsTask
from megatron_grpo.rollout.tasks.reward import PluginReward, load_reward_fn


def build_task(cfg: RolloutConfig, seed: int) -> Task:
    """The task named by ``cfg.task``; ``cfg.reward_fn`` (if set) replaces its reward."""
    if cfg.task == "reverse_digits":
        task: Task = ReverseDigitsTask(cfg.reverse_digits.num_digits, seed)
    elif cfg.task == "dataset":
        task = DatasetTask(cfg.dataset, cfg.max_prompt_length, seed)
    else:
        m = cfg.math
        task = MathTask(m.data_path, m.tokenizer_dir, m.prompt_template, seed)
    if cfg.reward_fn is not None:
        task.reward = PluginReward(load_reward_fn(cfg.reward_fn), task.tokenizer)  # type: ignore[method-assign]
    return task


__all__ = [
    "DatasetTask",
    "DigitTokenizer",
    "HFTokenizer",
    "MathTask",
    "PluginReward",
    "Prompt",
    "ReverseDigitsTask",
    "Task",
    "Tokenizer",
    "build_task",
    "load_reward_fn",
]
