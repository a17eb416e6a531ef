"""Evaluation under ``rollout.placement: separate``: the generators evaluate, the trainer logs.

The generation replicas run the colocated :class:`~megatron_grpo.rollout.evaluation.Evaluator`
as the data-parallel ranks of their own layout (the validation prompts spread over the
replicas, sums all-reduced among them) with the newest weights: right after a swap brings in
a policy version that is due (``evaluation.eval_due``, the colocated run's rule; the final weights arrive with the trainer's
``STOP``). The first rank of replica 0 sends the metrics and the summary line to every trainer
rank; :class:`GeneratorEvaluation` is the trainer's evaluator: it receives them for the step
whose metrics line they join, exactly where the colocated run evaluates (step 0 before the first
step of a fresh run, every ``evaluation.interval`` steps, after the last step). With one
replica of the trainer's TP and DP 1 the metrics equal the colocated run's (tested).
"""

from __future__ import annotations

from typing import Any

from megatron_grpo.rollout.config import EvaluationConfig
from megatron_grpo.rollout.evaluation import eval_due
from megatron_grpo.rollout.separate.channel import recv_eval
from megatron_grpo.rollout.separate.world import SeparateWorld


class GeneratorEvaluation:
    """The trainer ranks' evaluator under separate placement (module docstring): the
    :class:`~megatron_grpo.rollout.evaluation.Evaluator` interface, fed by the generators."""

    def __init__(self, cfg: EvaluationConfig, steps: int, world: SeparateWorld) -> None:
        self.cfg, self.steps, self.world = cfg, steps, world
        self.enabled = cfg.enabled
        self.monitor: Any = None

    def attach(self, model: object, source: object, monitor: Any = None) -> None:
        self.monitor = monitor

    def log_initial(self, start_step: int, monitor: Any) -> None:
        if self.enabled and start_step == 0:
            monitor.log(0, self._receive(0))

    def after_step(self, step: int) -> dict[str, float]:
        if not self.enabled or not eval_due(step, self.steps, self.cfg.interval):
            return {}
        return self._receive(step)

    def _receive(self, version: int) -> dict[str, float]:
        src = self.world.replica_leaders()[0]
        metrics, line = recv_eval(version, src, self.world.data_group)
        if self.monitor is not None:
            self.monitor.message(line)
        return metrics
