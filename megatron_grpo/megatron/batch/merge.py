"""Larger packed micro-batches for the no-grad log-prob passes.

A forward of a packed micro-batch costs the host the same launches at 1k tokens as at 32k (the
module code runs once per layer and micro-batch), so at the update's micro-batch size (bounded by
the backward's activation memory) the old / reference passes leave the GPU idle between
kernels. A no-grad pass keeps one layer's activations at a time: it can run several of the
update's micro-batches as one. :func:`merge_packed` concatenates consecutive micro-batches
(each keeps its sequences, so positions, RoPE and attention are unchanged) and
:func:`split_merged` cuts the per-token results back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_grpo.megatron.batch.packing import PackedBatch


def merge_groups(batches: Sequence[PackedBatch], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of ``batches`` (indices) of at most ``max_tokens`` tokens each.

    A batch longer than ``max_tokens`` stays alone; batches that differ in which optional
    fields they carry (e.g. ``routes``) are not merged.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    tokens, key = 0, None
    for i, b in enumerate(batches):
        k = _carried(b)
        if groups and k == key and tokens + b.num_tokens <= max_tokens:
            groups[-1].append(i)
            tokens += b.num_tokens
        else:
            groups.append([i])
            tokens, key = b.num_tokens, k
    return groups


def match_count(groups: list[list[int]], count: int) -> tuple[list[list[int]], int]:
    """``groups`` (of batch indices, in order) brought to ``count`` forwards, the largest count
    of the ranks whose forwards are collectives (MoE expert parallelism): merged groups are
    halved (the one of most batches first) until there are ``count`` or none holds two, the rest
    are extra forwards to run and discard. Returns (groups, extra forwards)."""
    groups = [list(g) for g in groups]
    while len(groups) < count and any(len(g) > 1 for g in groups):
        i = max(range(len(groups)), key=lambda j: (len(groups[j]), -j))
        half = len(groups[i]) // 2
        groups[i : i + 1] = [groups[i][:half], groups[i][half:]]
    return groups, max(count - len(groups), 0)


def merge_packed(batches: Sequence[PackedBatch]) -> PackedBatch:
    """One micro-batch holding every sequence of ``batches`` in order: per-token fields ``[T]``
    concatenated, ``cu_seqlens`` ``[S+1]`` offset. Each batch's padding (to the TP / CP
    multiple) stays its own sequence, so the merged length keeps that multiple."""
    if not batches:
        raise ValueError("merge_packed needs at least one batch")
    if len(batches) == 1:
        return batches[0]
    if len({_carried(b) for b in batches}) != 1:
        raise ValueError("merge_packed: the batches carry different optional fields")
    fields = {}
    for f in dataclasses.fields(PackedBatch):
        parts = [getattr(b, f.name) for b in batches]
        if f.name == "cu_seqlens":
            starts = torch.tensor([0] + [b.num_tokens for b in batches[:-1]]).cumsum(0)
            tail = [cu[1:] + int(s) for cu, s in zip(parts, starts, strict=True)]
            fields[f.name] = torch.cat([parts[0][:1], *tail]).to(parts[0].dtype)
        else:
            fields[f.name] = None if parts[0] is None else torch.cat(parts)
    return PackedBatch(**fields)


def split_merged(values: Tensor, batches: Sequence[PackedBatch]) -> list[Tensor]:
    """Cut a merged batch's per-token ``values`` ``[sum T_i, ...]`` into one per batch."""
    sizes = [b.num_tokens for b in batches]
    if values.shape[0] != sum(sizes):
        raise ValueError(f"values have {values.shape[0]} tokens, the batches {sum(sizes)}")
    return list(values.split(sizes))


def _carried(batch: PackedBatch) -> tuple[bool, ...]:
    return tuple(getattr(batch, f.name) is not None for f in dataclasses.fields(PackedBatch))
