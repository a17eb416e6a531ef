"""Tensor-parallel communication of the log-prob op (plain torch.distributed on an explicit group).

Megatron's ``tensor_parallel.mappings`` helpers allocate on ``torch.cuda.current_device()``; the
op must also run on CPU (gloo), so the few collectives it needs are written against
``torch.distributed`` with the caller's group. ``group=None`` means a TP world of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


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


def combine_row_stats(
    m: Tensor, s: Tensor, zt: Tensor, b: Tensor | None, tp: TPInfo
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Combines per-shard row stats (``logits_row_stats`` outputs, each [R]) into global ones.

    Two collectives: all-reduce MAX of m, then ONE all-reduce SUM of the stacked
    ``[s * exp(m - M), zt, b * exp(m - M)]``.

    Returns:
        ``(lse, zt, pz)``, each [R] float32: global log-sum-exp, the target's scaled logit and
        ``sum_j p_j z_j`` (None without b). ``logp = zt - lse``, ``entropy = lse - pz``.
    """
    big_m = m.clone()
    if tp.size > 1:
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp.group)
    # An empty shard has m = -inf: exp(-inf - M) is 0 anyway, but -inf - (-inf) would be NaN.
    scale = torch.where(torch.isfinite(m), torch.exp(m - big_m), torch.zeros_like(m))
    parts = [s * scale, zt] + ([b * scale] if b is not None else [])
    stacked = all_reduce_sum_(torch.stack(parts), tp)
    lse = big_m + torch.log(stacked[0])
    pz = stacked[2] / stacked[0] if b is not None else None
    return lse, stacked[1], pz
