"""Loss denominators: the counts that make the loss independent of how a step is split.

Convention: ``grpo_loss`` returns ``SUM over local valid tokens of coef_t * objective_t``, where
``coef_t`` includes ``1 / denominator`` (and ``1 / |y_i|`` or ``1 / max_response_length`` for the
sequence modes). With ``denominator`` = the count over the whole optimizer step (every
micro-batch, every DP and CP rank), the gradients summed over micro-batches and ranks are those of
the full-batch loss, whatever the split: e.g. (100 * 0.5 + 900 * 0.3) / 1000 = 0.32, never the
mean of means 0.4. The count is tokens for ``token_mean`` and sequences with >= 1 valid token for
the ``seq_mean_*`` modes.

Two ways to use it:

* **Megatron per-token path** (``calculate_per_token_loss=True``): call ``grpo_loss`` with
  ``denominator=1.0`` and return ``(loss, local_denominator(cfg, loss_mask, cu_seqlens, cp_group),
  report)`` from ``forward_step``; Megatron sums the counts over micro-batches and the DP x CP
  group and divides the gradients by it, so nothing else is needed.
* **Own loop / DDP that averages gradients**: call :func:`global_denominators` once per step and
  pass ``denominators.for_loss(cfg)`` as ``denominator``. DDP then *averages* the summed-loss
  gradients over the DP world, so multiply the loss (or the gradients) by the DP world size
  (x the CP size too when the CP ranks are inside the averaging group) to undo it.

Context parallelism: every CP rank holds all S sequence slots of the micro-batch (possibly with 0
local tokens). Token counts are summed over CP. A sequence split over CP ranks must be counted
once: with ``cp_group`` the per-sequence token counts are all-reduced over CP and the sequence is
counted on CP rank 0 only, so the sum over ranks counts it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.loss.config import GRPOLossConfig
from megatron_grpo.loss.segments import (
    check_cu_seqlens,
    host_to_device,
    segment_ids,
    segment_sum,
)


@dataclass(frozen=True)
class Denominators:
    """Global counts of one optimizer step: valid ``tokens`` and ``sequences`` (>= 1 valid token)."""

    tokens: float
    sequences: float

    def for_loss(self, cfg: GRPOLossConfig) -> float:
        """The count ``cfg.loss_agg`` divides by (sequences for ``seq_mean_*``, else tokens)."""
        return self.sequences if cfg.agg_counts_sequences else self.tokens


def sequence_token_counts(
    loss_mask: Tensor, cu_seqlens: Tensor, cp_group: dist.ProcessGroup | None = None
) -> Tensor:
    """Valid tokens per sequence, ``[S]`` float32, summed over ``cp_group`` when given."""
    if loss_mask.dtype != torch.bool or loss_mask.dim() != 1:
        raise ValueError(
            f"loss_mask must be a bool [T] tensor, got {loss_mask.dtype} {list(loss_mask.shape)}"
        )
    total = loss_mask.numel()
    check_cu_seqlens(cu_seqlens, total)
    seg = segment_ids(host_to_device(cu_seqlens, loss_mask.device), total)
    return segment_sum(loss_mask.float(), seg, cu_seqlens.numel() - 1, cp_group)


def _counts(
    loss_mask: Tensor, cu_seqlens: Tensor, cp_group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """(local valid tokens, sequences counted by this rank) as float64 scalars."""
    per_seq = sequence_token_counts(loss_mask, cu_seqlens, cp_group)
    seqs = (per_seq > 0).sum().double()
    if cp_group is not None and dist.get_rank(cp_group) != 0:
        seqs = torch.zeros_like(seqs)
    return loss_mask.sum().double(), seqs


def local_denominator(
    cfg: GRPOLossConfig,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    cp_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """This rank's share of the ``cfg.loss_agg`` count for one micro-batch (float32 scalar).

    ``loss_mask`` bool ``[T]``, ``cu_seqlens`` ``[S+1]``. Summed over micro-batches and the
    DP x CP ranks it equals the global count (what Megatron's per-token-loss path does).
    """
    tokens, seqs = _counts(loss_mask, cu_seqlens, cp_group)
    return (seqs if cfg.agg_counts_sequences else tokens).float()


def global_denominators(
    loss_mask_list: Sequence[Tensor],
    cu_seqlens_list: Sequence[Tensor],
    group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> Denominators:
    """Counts over all micro-batches of a step and all ranks of ``group``, one all-reduce.

    Args:
        loss_mask_list / cu_seqlens_list: this rank's micro-batches (bool ``[T]``, ``[S+1]``).
        group: the group to sum over, usually data-parallel (x CP when the inputs are CP
            shards). Without an initialised process group the counts stay local.
        cp_group: pass it when the inputs are CP shards, to count a split sequence once (one
            extra all-reduce per micro-batch). Not needed when the inputs are the unsplit
            micro-batches, in which case ``group`` must not include the CP ranks.

    Returns:
        :class:`Denominators`; ``.for_loss(cfg)`` picks the one ``cfg.loss_agg`` needs.
    """
    if len(loss_mask_list) != len(cu_seqlens_list):
        raise ValueError(
            f"loss_mask_list and cu_seqlens_list must have the same length, got "
            f"{len(loss_mask_list)} and {len(cu_seqlens_list)}"
        )
    totals = torch.zeros(2, dtype=torch.float64)
    for mask, cu in zip(loss_mask_list, cu_seqlens_list, strict=True):
        tokens, seqs = _counts(mask, cu, cp_group)
        totals += torch.stack([tokens, seqs]).cpu()
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend(group) == "nccl":
            totals = totals.cuda()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    tokens, seqs = totals.cpu().tolist()
    return Denominators(tokens=tokens, sequences=seqs)
