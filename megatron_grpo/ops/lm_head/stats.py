"""Named per-row softmax statistics of the LM head and THE log-sum-exp merge.

Every pass reduces a row's logits to a few numbers, first per vocab tile (the kernel seam), then
over tiles, then over TP ranks. The two merges are the same algebra, with ``M = max_i m_i``::

    s = sum_i s_i exp(m_i - M),   zt = sum_i zt_i,   b = sum_i b_i exp(m_i - M)

so one function (:func:`merge_row_stats`) does both; only the reduction differs: over a stacked
leading axis (:data:`OVER_TILES`) or over the TP group (``ops.lm_head.comm.combine_row_stats``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


class RowStats(NamedTuple):
    """Local softmax statistics of ``z = logits / temperature`` over some valid columns, each
    ``[R]`` fp32 (``[K, R]`` when K parts are stacked), as ``logits_row_stats`` returns them."""

    m: Tensor  # max z (-inf over no column)
    s: Tensor  # sum exp(z - m)
    zt: Tensor  # z[target] where the target is among the columns, else 0
    b: Tensor | None  # sum exp(z - m) * z (entropy numerator); None without entropy

    @staticmethod
    def identity(rows: int, device: torch.device, with_b: bool) -> RowStats:
        """The statistics of no column (an all-padded shard): the merge's identity."""
        zeros = torch.zeros(rows, device=device)
        b = zeros.clone() if with_b else None
        return RowStats(torch.full_like(zeros, float("-inf")), zeros, zeros.clone(), b)

    @staticmethod
    def empty(rows: int, device: torch.device, with_b: bool) -> RowStats:
        """Uninitialized ``[rows]`` buffers, filled block by block with :meth:`write`."""
        new = [torch.empty(rows, device=device) for _ in range(4 if with_b else 3)]
        return RowStats(*new[:3], new[3] if with_b else None)

    def write(self, start: int, stop: int, value: RowStats) -> None:
        """Rows ``start:stop`` of these buffers = ``value``."""
        for dst, src in zip(self, value, strict=True):
            if dst is not None:
                dst[start:stop] = src

    @staticmethod
    def stack(parts: list[RowStats]) -> RowStats:
        """K parts of ``[R]`` -> one of ``[K, R]``."""
        with_b = parts[0].b is not None
        fields = [torch.stack([p[i] for p in parts]) for i in range(4 if with_b else 3)]
        return RowStats(*fields[:3], fields[3] if with_b else None)


class Reduction(NamedTuple):
    """How :func:`merge_row_stats` combines parts: ``max`` of m ``[...] -> [R]`` and ``sum`` of
    the stacked ``[P, ...]`` rescaled fields ``-> [P, R]``."""

    max: Callable[[Tensor], Tensor]
    sum: Callable[[Tensor], Tensor]


# Parts stacked along a leading axis: m [K, R], fields [P, K, R].
OVER_TILES = Reduction(max=lambda m: m.amax(0), sum=lambda x: x.sum(1))


def merge_row_stats(parts: RowStats, reduce: Reduction) -> RowStats:
    """Merges the parts of ``parts`` (see :class:`Reduction`) into one :class:`RowStats`.

    An all-masked part has ``m = -inf``: its scale is 0 (``exp(-inf - M)`` is 0 anyway, but
    ``-inf - (-inf)`` would be NaN when every part is empty). The target logit is in at most one
    part (0 elsewhere), so its plain sum is exact.
    """
    big_m = reduce.max(parts.m)
    scale = torch.where(torch.isfinite(parts.m), torch.exp(parts.m - big_m), 0.0)
    fields = [parts.s * scale, parts.zt] + ([parts.b * scale] if parts.b is not None else [])
    summed = reduce.sum(torch.stack(fields))
    return RowStats(big_m, summed[0], summed[1], summed[2] if parts.b is not None else None)


class GlobalRowStats(NamedTuple):
    """Statistics of a row over the whole (TP-sharded) vocabulary, each ``[R]`` fp32."""

    lse: Tensor  # log sum_j exp(z_j)
    zt: Tensor  # z[target]
    pz: Tensor | None  # sum_j p_j z_j (None without entropy)

    @staticmethod
    def of(merged: RowStats) -> GlobalRowStats:
        """From statistics merged over every column of the vocabulary."""
        pz = merged.b / merged.s if merged.b is not None else None
        return GlobalRowStats(merged.m + torch.log(merged.s), merged.zt, pz)

    @property
    def logp(self) -> Tensor:
        return self.zt - self.lse

    @property
    def entropy(self) -> Tensor:
        return self.lse - self.pz


@dataclass(frozen=True)
class RowGrads:
    """Per-row inputs of the logits gradient, each [R] fp32 (g_ent and pz both or neither)."""

    lse: Tensor
    g_logp: Tensor
    g_ent: Tensor | None
    pz: Tensor | None

    def rows(self, start: int, stop: int) -> RowGrads:
        def cut(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[start:stop]

        return RowGrads(*(cut(x) for x in (self.lse, self.g_logp, self.g_ent, self.pz)))
