"""GRPO loss family in pure PyTorch (imports nothing from Megatron).

Public API: :func:`grpo_loss`, :class:`GRPOLossConfig`, :class:`LossInputs`,
:func:`compute_advantages`, :func:`global_denominators` / :func:`local_denominator`,
:func:`reduce_metrics`, :func:`pack_padded` / :func:`unpack_to_padded`. The fused-path seam lives in
:mod:`megatron_grpo.loss.math` (``build_context`` / ``objective``).
"""

from megatron_grpo.loss.advantages import compute_advantages
from megatron_grpo.loss.config import GRPOLossConfig
from megatron_grpo.loss.grpo import grpo_loss
from megatron_grpo.loss.inputs import LossInputs
from megatron_grpo.loss.math import LossContext, build_context, objective
from megatron_grpo.loss.metrics import (
    MaxMetric,
    MeanMetric,
    MinMetric,
    SumMetric,
    merge_metrics,
    reduce_metrics,
)
from megatron_grpo.loss.packing import pack_padded, unpack_to_padded
from megatron_grpo.loss.reduction import Denominators, global_denominators, local_denominator

__all__ = [
    "Denominators",
    "GRPOLossConfig",
    "LossContext",
    "LossInputs",
    "MaxMetric",
    "MeanMetric",
    "MinMetric",
    "SumMetric",
    "build_context",
    "compute_advantages",
    "global_denominators",
    "grpo_loss",
    "local_denominator",
    "merge_metrics",
    "objective",
    "pack_padded",
    "reduce_metrics",
    "unpack_to_padded",
]
