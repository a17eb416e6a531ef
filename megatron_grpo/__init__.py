"""megatron-grpo: GRPO-family RL training on Megatron-Core.

Top-level API (importing it does not import Megatron):

* :func:`grpo_loss`, :class:`GRPOLossConfig`, :func:`compute_advantages`,
  :func:`global_denominators`, :func:`local_denominator`, :func:`reduce_metrics` — the loss family;
* :class:`LossInputs` — a micro-batch's loss inputs (``LossInputs.from_batch``);
* :func:`vocab_parallel_logprobs`, :func:`fused_grpo_loss` — the vocab-parallel log-prob op and
  the fused LM-head + GRPO loss; :class:`LMHeadOptions` — their options.
"""

from megatron_grpo.loss import (
    Denominators,
    GRPOLossConfig,
    LossInputs,
    MaxMetric,
    MeanMetric,
    MinMetric,
    SumMetric,
    compute_advantages,
    global_denominators,
    grpo_loss,
    local_denominator,
    merge_metrics,
    pack_padded,
    reduce_metrics,
    unpack_to_padded,
)
from megatron_grpo.ops import LMHeadOptions, fused_grpo_loss, vocab_parallel_logprobs

__version__ = "0.1.0"

__all__ = [
    "Denominators",
    "GRPOLossConfig",
    "LMHeadOptions",
    "LossInputs",
    "MaxMetric",
    "MeanMetric",
    "MinMetric",
    "SumMetric",
    "compute_advantages",
    "fused_grpo_loss",
    "global_denominators",
    "grpo_loss",
    "local_denominator",
    "merge_metrics",
    "pack_padded",
    "reduce_metrics",
    "unpack_to_padded",
    "vocab_parallel_logprobs",
]
