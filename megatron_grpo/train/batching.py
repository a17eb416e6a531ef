"""From a rank's ``RolloutBatch`` to mini-batches of packed micro-batches (``PackedBatch``).

MoE with expert parallelism makes every forward a collective over the ranks that exchange
tokens, so those ranks must run the same number of micro-batches (``count_group``) and, under
the "allgather" token dispatcher, micro-batch ``i`` must hold the same number of tokens on each
of them (``token_group``): shorter ones get trailing all-masked padding documents.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.batch.packing import PackedBatch, pack_sequences, padded_layout
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.parallel import all_reduce_max
from megatron_grpo.rollout.batch import RolloutBatch

PER_TOKEN_INPUTS = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


def micro_batch_indices(
    lengths: list[int], micro_batch_size: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Consecutive sample indices per micro-batch: ``micro_batch_size`` samples each, or greedy
    packing up to ``max_tokens`` tokens (a longer sample forms a micro-batch of its own)."""
    if micro_batch_size is not None:
        n = len(lengths)
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    if max_tokens is None:
        raise ValueError("one of micro_batch_size / max_tokens_per_micro_batch is required")
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if not out or used + n > max_tokens:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def pack_samples(
    batch: RolloutBatch,
    idx: list[int],
    advantages: Tensor,
    pad_to_multiple_of: int,
    with_routes: bool = False,
) -> PackedBatch:
    """Pack samples ``idx`` with their advantages ``[B]`` and rollout log-probs (if any);
    ``with_routes``: also their ``routed_experts`` (MoE routing replay)."""
    seqs, masks, rollout = [], [], []
    for i in idx:
        p, r = batch.prompt_ids[i], batch.response_ids[i]
        seqs.append(torch.tensor(p + r, dtype=torch.long))
        masks.append(torch.tensor([False] * len(p) + [True] * len(r)))
        if batch.rollout_logprobs is not None:
            rollout.append(torch.tensor([0.0] * len(p) + batch.rollout_logprobs[i]))
    return pack_sequences(
        seqs,
        masks,
        advantages=advantages[idx],
        rollout_logprobs=rollout if batch.rollout_logprobs is not None else None,
        routes=[batch.routed_experts[i] for i in idx] if with_routes else None,
        pad_to_multiple_of=pad_to_multiple_of,
    )


def make_mini_batches(
    batch: RolloutBatch,
    advantages: Tensor,
    num_mini_batches: int,
    micro_batch_size: int | None,
    max_tokens: int | None,
    layout: ParallelLayout | None = None,
    *,
    count_group: dist.ProcessGroup | None = None,
    token_group: dist.ProcessGroup | None = None,
    with_routes: bool = False,
) -> list[list[PackedBatch]]:
    """Split the samples in order into ``num_mini_batches`` equal parts (one optimizer step
    each), then into packed micro-batches, padded by ``layout``'s rules (its
    ``token_multiple`` and, under CP, ``sequence_multiple``; None: no padding).

    ``count_group``: give each mini-batch the group's largest micro-batch count (by splitting
    the micro-batches with the most samples). ``token_group``: pad micro-batch ``i`` to the
    group's largest token count (after context-parallel per-document padding when
    ``cp_size > 1``), so that every rank's ``i``-th forward has the same local length.
    """
    layout = layout or ParallelLayout()
    multiple, cp_size = layout.token_multiple, layout.cp_size
    n = len(batch)
    if n % num_mini_batches:
        raise ValueError(
            f"this rank's {n} samples cannot be split into training.mini_batches_per_step="
            f"{num_mini_batches} equal mini-batches"
        )
    size = n // num_mini_batches
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
    plan = []
    for start in range(0, n, size):
        rows = list(range(start, start + size))
        groups = micro_batch_indices([lengths[i] for i in rows], micro_batch_size, max_tokens)
        plan.append([[rows[j] for j in g] for g in groups])
    if count_group is not None:
        targets = all_reduce_max([len(groups) for groups in plan], count_group, torch.int64)
        plan = [split_to_count(groups, k) for groups, k in zip(plan, targets, strict=True)]
    out = [
        [pack_samples(batch, g, advantages, multiple, with_routes) for g in groups]
        for groups in plan
    ]
    if token_group is not None:
        flat = [mb for mini in out for mb in mini]
        sizes = [_layout_tokens(mb, cp_size, multiple) for mb in flat]
        targets = iter(all_reduce_max(sizes, token_group, torch.int64))
        step = layout.sequence_multiple
        out = [
            [
                pad_micro_batch(mb, next(targets) - _layout_tokens(mb, cp_size, multiple), step)
                for mb in mini
            ]
            for mini in out
        ]
    return out


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """Halve the micro-batch with the most samples (first one on ties) until there are
    ``count``; sample order is kept."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        i = max(range(len(groups)), key=lambda j: (len(groups[j]), -j))
        if len(groups[i]) < 2:
            raise ValueError(
                f"cannot split {sum(map(len, groups))} samples into {count} micro-batches to "
                "match the other ranks of the expert-parallel group"
            )
        half = len(groups[i]) // 2
        groups[i : i + 1] = [groups[i][:half], groups[i][half:]]
    return groups


def pad_micro_batch(mb: PackedBatch, extra: int, step: int = 1) -> PackedBatch:
    """Append ``extra`` tokens (a multiple of ``step``) as all-masked documents (token 0, zero
    per-token values). Each padding document is at most as long as the longest real document
    rounded down to ``step`` (at least ``step``) so that positions stay within the model's
    range."""
    if extra < 0 or extra % step:
        raise ValueError(f"padding of {extra} tokens is negative or not a multiple of {step}")
    if extra == 0:
        return mb
    chunk = max(step, mb.max_seqlen // step * step)
    docs = [chunk] * (extra // chunk) + ([extra % chunk] if extra % chunk else [])
    ends = mb.cu_seqlens[-1] + torch.tensor(docs).cumsum(0)
    cu = torch.cat([mb.cu_seqlens, ends.to(mb.cu_seqlens.dtype)])
    zeros = torch.zeros(extra, dtype=torch.long)
    fields = {
        "tokens": torch.cat([mb.tokens, zeros]),
        "position_ids": torch.cat([mb.position_ids, torch.cat([torch.arange(d) for d in docs])]),
        "targets": torch.cat([mb.targets, zeros]),
        "loss_mask": torch.cat([mb.loss_mask, torch.zeros(extra, dtype=torch.bool)]),
    }
    for name in PER_TOKEN_INPUTS:
        x = getattr(mb, name)
        if x is not None:
            fields[name] = torch.cat([x, x.new_zeros(extra)])
    if mb.routes is not None:  # padding tokens route live
        fields["routes"] = torch.cat(
            [mb.routes, mb.routes.new_full((extra, *mb.routes.shape[1:]), -1)]
        )
    return PackedBatch(cu_seqlens=cu, **fields)


def _layout_tokens(mb: PackedBatch, cp_size: int, multiple: int) -> int:
    """Tokens of ``mb``'s forward across all CP ranks (after per-document CP padding)."""
    if cp_size == 1:
        return mb.num_tokens
    return int(padded_layout(mb, cp_size, multiple)[0][-1])


def nonfinite_inputs(micro_batches: list[PackedBatch]) -> list[bool]:
    """For each name in ``PER_TOKEN_INPUTS``: does any micro-batch hold a non-finite value at a
    ``loss_mask`` position? The flags are computed where the values are and read on the host
    together: one sync per device, not two per field and micro-batch."""
    by_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
    for mb in micro_batches:
        masks: dict[torch.device, Tensor] = {}  # loss_mask moved once per device
        for i, name in enumerate(PER_TOKEN_INPUTS):
            x = getattr(mb, name)
            if x is not None:
                if x.device not in masks:
                    masks[x.device] = host_to_device(mb.loss_mask, x.device)
                mask = masks[x.device]
                by_device.setdefault(x.device, []).append((i, (~torch.isfinite(x) & mask).any()))
    flags = [False] * len(PER_TOKEN_INPUTS)
    for found in by_device.values():
        values = torch.stack([bad for _, bad in found]).tolist()
        for (i, _), bad in zip(found, values, strict=True):
            flags[i] = flags[i] or bad
    return flags


def attach_logprobs(
    mini_batches: list[list[PackedBatch]], old: list[Tensor] | None, ref: list[Tensor] | None
) -> list[list[PackedBatch]]:
    """New mini-batches with the no-grad passes' ``old`` / ``ref`` log-probs: one ``[T]`` per
    micro-batch, in order (None: that pass did not run, the field is None)."""
    n = sum(len(mini) for mini in mini_batches)
    pairs = iter(zip(old or [None] * n, ref or [None] * n, strict=True))
    return [[_with_logprobs(mb, *next(pairs)) for mb in mini] for mini in mini_batches]


def _with_logprobs(mb: PackedBatch, old: Tensor | None, ref: Tensor | None) -> PackedBatch:
    return dataclasses.replace(mb, old_logprobs=old, ref_logprobs=ref)
