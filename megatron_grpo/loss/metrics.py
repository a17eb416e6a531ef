"""Metric values that aggregate exactly across row chunks, micro-batches and ranks.

A metric is a small value object: :class:`MeanMetric` keeps ``(sum, count)``, :class:`SumMetric`
a sum, :class:`MinMetric` / :class:`MaxMetric` an extremum. ``a.merge(b)`` combines two of the
same kind; :func:`reduce_metrics` merges a list of ``{key: metric}`` dicts and all-reduces them
over a process group with one collective per kind (SUM for mean/sum, MIN, MAX), so a mean over
ranks is the token-weighted mean, never a mean of means. Values stay (detached) tensors until
:func:`reduce_metrics`, so building them costs no host sync. A mean or extremum over zero
samples reduces to NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

Number = Tensor | float


def _f32(x: Number) -> Tensor:
    return x.detach().float() if isinstance(x, Tensor) else torch.tensor(float(x))


@dataclass
class MeanMetric:
    """Mean as ``sum / count``; merged by adding both."""

    sum: Number
    count: Number

    @classmethod
    def of(cls, values: Tensor) -> MeanMetric:
        """Mean of the elements of ``values`` ``[N]``."""
        values = values.detach().float()
        # torch.full, not torch.tensor(..., device=): a host-to-device copy syncs the stream
        return cls(values.sum(), torch.full((), float(values.numel()), device=values.device))

    def merge(self, other: MeanMetric) -> MeanMetric:
        return MeanMetric(_f32(self.sum) + _f32(other.sum), _f32(self.count) + _f32(other.count))


@dataclass
class SumMetric:
    """A total (e.g. a count of events); merged by adding."""

    sum: Number

    def merge(self, other: SumMetric) -> SumMetric:
        return SumMetric(_f32(self.sum) + _f32(other.sum))


@dataclass
class MinMetric:
    """Minimum; ``+inf`` when empty."""

    value: Number

    @classmethod
    def of(cls, values: Tensor) -> MinMetric:
        v = values.detach().float()
        return cls(v.min() if v.numel() else torch.full((), math.inf, device=v.device))

    def merge(self, other: MinMetric) -> MinMetric:
        return MinMetric(torch.minimum(_f32(self.value), _f32(other.value)))


@dataclass
class MaxMetric:
    """Maximum; ``-inf`` when empty."""

    value: Number

    @classmethod
    def of(cls, values: Tensor) -> MaxMetric:
        v = values.detach().float()
        return cls(v.max() if v.numel() else torch.full((), -math.inf, device=v.device))

    def merge(self, other: MaxMetric) -> MaxMetric:
        return MaxMetric(torch.maximum(_f32(self.value), _f32(other.value)))


Metric = MeanMetric | SumMetric | MinMetric | MaxMetric
MetricDict = dict[str, Metric]


def merge_metrics(dicts: Iterable[Mapping[str, Metric]]) -> MetricDict:
    """Merge metric dicts key by key (a key must keep one kind)."""
    out: MetricDict = {}
    for d in dicts:
        for key, m in d.items():
            if key not in out:
                out[key] = m
                continue
            if type(out[key]) is not type(m):
                raise TypeError(
                    f"metric {key!r} is a {type(out[key]).__name__} here and a "
                    f"{type(m).__name__} there"
                )
            out[key] = out[key].merge(m)  # type: ignore[arg-type]
    return out


def reduce_metrics(
    metric_dicts: Iterable[Mapping[str, Metric]], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Merge ``metric_dicts`` and, when ``torch.distributed`` is initialised, all-reduce over
    ``group`` (None = the default group). Every rank must hold the same keys.

    Returns ``{key: float}`` (means are ``sum / count`` of the global totals).
    """
    merged = merge_metrics(metric_dicts)
    keys = sorted(merged)
    sums = [k for k in keys if isinstance(merged[k], (MeanMetric, SumMetric))]
    mins = [k for k in keys if isinstance(merged[k], MinMetric)]
    maxs = [k for k in keys if isinstance(merged[k], MaxMetric)]
    sum_vals = [_f32(v) for k in sums for v in _sum_parts(merged[k])]
    sum_vals = _all_reduce(sum_vals, dist.ReduceOp.SUM, group)
    min_vals = _all_reduce([_f32(merged[k].value) for k in mins], dist.ReduceOp.MIN, group)
    max_vals = _all_reduce([_f32(merged[k].value) for k in maxs], dist.ReduceOp.MAX, group)
    out: dict[str, float] = {}
    pos = 0
    for k in sums:
        if isinstance(merged[k], MeanMetric):
            total, count = sum_vals[pos], sum_vals[pos + 1]
            out[k] = total / count if count > 0 else math.nan
            pos += 2
        else:
            out[k] = sum_vals[pos]
            pos += 1
    for k, v in zip(mins + maxs, min_vals + max_vals, strict=True):
        out[k] = v if math.isfinite(v) else math.nan
    return out


def _sum_parts(m: Metric) -> tuple[Number, ...]:
    return (m.sum, m.count) if isinstance(m, MeanMetric) else (m.sum,)  # type: ignore[union-attr]


def _all_reduce(values: list[Tensor], op: dist.ReduceOp, group: dist.ProcessGroup | None):
    """One collective over a stacked float64 vector; returns python floats."""
    if not values:
        return []
    flat = torch.stack([v.reshape(()).to(torch.float64).cpu() for v in values])
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend(group) == "nccl":
            flat = flat.cuda()
        dist.all_reduce(flat, op=op, group=group)
    return flat.cpu().tolist()
