"""The log-prob path of a ``GRPOStep``, chosen once when the step is built.

:func:`choose_path` turns the step's :class:`~megatron_grpo.ops.lm_head.options.LMHeadOptions` (its
``path``, one of :data:`megatron_grpo.ops.lm_head.options.REQUESTS`) into an object with the two things
a step needs on the last stage: the training loss of a micro-batch and its no-grad log-probs.

* :class:`HeadOpPath` ("fused", "fused_tiled", "fused_single_pass", "op"): the LM-head op on
  the output weight; the plan of each call picks how it runs (:mod:`megatron_grpo.ops.lm_head.plan`).
* :class:`MegatronPath` ("megatron"): Megatron's output layer and cross entropy
  (:func:`megatron_grpo.megatron.step.baseline.megatron_logprobs`), then ``grpo_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from megatron.core.models.gpt import GPTModel
from torch import Tensor

from megatron_grpo.loss import GRPOLossConfig, LossInputs, grpo_loss
from megatron_grpo.loss.metrics import MetricDict
from megatron_grpo.megatron.gpt import output_weight
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.step.baseline import megatron_logprobs
from megatron_grpo.ops import fused_grpo_loss, vocab_parallel_logprobs
from megatron_grpo.ops.lm_head.options import LMHeadOptions
from megatron_grpo.ops.lm_head.plan import HeadRequest, resolve_request

# on-policy IS weights of these levels need each sequence's current log-probs first


class LogprobPath(Protocol):
    """What a step runs on the last stage's hidden states ``[T_local, H]``."""

    options: LMHeadOptions

    def loss(
        self,
        cfg: GRPOLossConfig,
        gpt: GPTModel,
        hidden: Tensor,
        targets: Tensor,
        inputs: LossInputs,
        layout: ParallelLayout,
    ) -> tuple[Tensor, MetricDict]:
        """The micro-batch's GRPO loss and metrics (``targets``, ``inputs``: ``[T_local]``)."""
        ...

    def logprobs(
        self, gpt: GPTModel, hidden: Tensor, targets: Tensor, rows: Tensor, layout: ParallelLayout
    ) -> Tensor:
        """float32 ``[T_local]`` log-probs at the bool ``rows``, 0 elsewhere."""
        ...


@dataclass(frozen=True)
class HeadOpPath:
    """The LM-head op: ``fused_grpo_loss`` for the loss (``request``: the loss's request,
    resolved once when the step was built), ``vocab_parallel_logprobs`` for log-probs alone."""

    options: LMHeadOptions
    request: HeadRequest

    def loss(
        self,
        cfg: GRPOLossConfig,
        gpt: GPTModel,
        hidden: Tensor,
        targets: Tensor,
        inputs: LossInputs,
        layout: ParallelLayout,
    ) -> tuple[Tensor, MetricDict]:
        loss, metrics, _ = fused_grpo_loss(
            hidden,
            output_weight(gpt),
            targets,
            cfg,
            inputs,
            options=self.options,
            tp_group=layout.tp_group,
            sequence_parallel=layout.sequence_parallel,
            request=self.request,
        )
        return loss, metrics

    def logprobs(
        self, gpt: GPTModel, hidden: Tensor, targets: Tensor, rows: Tensor, layout: ParallelLayout
    ) -> Tensor:
        return vocab_parallel_logprobs(
            hidden,
            output_weight(gpt),
            targets,
            self.options,
            tp_group=layout.tp_group,
            sequence_parallel=layout.sequence_parallel,
            rows=rows,
        )


@dataclass(frozen=True)
class MegatronPath:
    """Megatron's output layer on materialized logits, then ``grpo_loss`` (the baseline)."""

    options: LMHeadOptions

    def loss(
        self,
        cfg: GRPOLossConfig,
        gpt: GPTModel,
        hidden: Tensor,
        targets: Tensor,
        inputs: LossInputs,
        layout: ParallelLayout,
    ) -> tuple[Tensor, MetricDict]:
        return grpo_loss(cfg, inputs, logprobs=self._logprobs(gpt, hidden, targets, layout))

    def logprobs(
        self, gpt: GPTModel, hidden: Tensor, targets: Tensor, rows: Tensor, layout: ParallelLayout
    ) -> Tensor:
        return self._logprobs(gpt, hidden, targets, layout) * rows

    def _logprobs(
        self, gpt: GPTModel, hidden: Tensor, targets: Tensor, layout: ParallelLayout
    ) -> Tensor:
        return megatron_logprobs(
            gpt.output_layer,
            output_weight(gpt),
            hidden,
            targets,
            vocab_size=self.options.vocab_size,
            tp_rank=layout.tp_rank,
            temperature=self.options.temperature,
        )


def choose_path(cfg: GRPOLossConfig, options: LMHeadOptions, on_policy: bool) -> LogprobPath:
    """The path object of a step's options (the plan's checks run here: entropy with
    "megatron", GSPO with "fused_single_pass"). On-policy with a sequence-level IS correction
    the automatic fused request becomes "fused_tiled" (the IS weight needs whole sequences of
    current log-probs); "fused_single_pass" is refused."""
    request = resolve_request(options.path, cfg)  # once per step (a sequence ratio: GSPO too)
    if request.path == "megatron":
        return MegatronPath(options)
    # on-policy only (a sequence ratio is the plan's: resolve_request above)
    if cfg.needs_whole_sequences(on_policy) and not cfg.needs_whole_sequences():
        if options.path == "fused_single_pass":
            raise ValueError(
                "logprob_path 'fused_single_pass' runs the loss chunk by chunk, but on-policy "
                f"is_correction_level {cfg.is_correction_level!r} weighs each sequence by all "
                "of its current log-probs: use 'fused' / 'fused_tiled' or 'op'"
            )
        if request.path == "fused":
            why = f"on-policy is_correction_level {cfg.is_correction_level!r}: whole sequences"
            request = HeadRequest("fused_tiled", why)
    return HeadOpPath(options, request)
