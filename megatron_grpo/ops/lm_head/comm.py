"""Tensor-parallel communication of the log-prob op (plain torch.distributed on an explicit group).

Megatron's ``tensor_parallel.mappings`` helpers allocate on ``torch.cuda.current_device()``; the
op must also run on CPU (gloo), so the few collectives it needs are written against
``torch.distributed`` with the caller's group. ``group=None`` means a TP world of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from megatron_grpo.ops.lm_head.stats import GlobalRowStats, Reduction, RowStats, merge_row_stats


@dataclass(frozen=True)
class TPInfo:
    """The TP group with its size and this process's rank in it (size 1 when group is None)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @staticmethod
    def of(group: dist.ProcessGroup | None) -> TPInfo:
        if group is None:
            return TPInfo(None, 1, 0)
        return TPInfo(group, dist.get_world_size(group), dist.get_rank(group))


# torch 2.13 renamed all_gather_into_tensor (same signature) and deprecates the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_rows(x: Tensor, tp: TPInfo) -> Tensor:
    """[T_local, ...] -> [T_local * tp.size, ...], rank-major (sequence-parallel gather)."""
    if tp.size == 1:
        return x
    out = x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=tp.group)
    return out


def reduce_scatter_rows(x: Tensor, tp: TPInfo) -> Tensor:
    """[T, ...] summed over ranks -> this rank's [T / tp.size, ...] slice."""
    if tp.size == 1:
        return x
    out = x.new_empty((x.shape[0] // tp.size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=tp.group)
    return out


def all_reduce_sum_(x: Tensor, tp: TPInfo) -> Tensor:
    """In-place SUM over the TP group."""
    if tp.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp.group)
    return x


def combine_row_stats(local: RowStats, tp: TPInfo) -> GlobalRowStats:
    """Combines this shard's row stats (each [R]) into the global ones with the log-sum-exp
    merge of :func:`megatron_grpo.ops.lm_head.stats.merge_row_stats` over the TP group.

    Two collectives: all-reduce MAX of m, then ONE all-reduce SUM of the stacked
    ``[s * exp(m - M), zt, b * exp(m - M)]``. ``logp = zt - lse``, ``entropy = lse - pz``.
    """
    return GlobalRowStats.of(merge_row_stats(local, _over_ranks(tp)))


def _over_ranks(tp: TPInfo) -> Reduction:
    """The merge's reduction over the TP group (each rank's part is its own [R] stats)."""

    def all_max(m: Tensor) -> Tensor:
        big_m = m.clone()
        if tp.size > 1:
            dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp.group)
        return big_m

    return Reduction(max=all_max, sum=lambda x: all_reduce_sum_(x, tp))
