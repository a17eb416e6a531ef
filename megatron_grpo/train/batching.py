"""From a rank's ``RolloutBatch`` to mini-batches of packed micro-batches (``PackedBatch``)."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.megatron.batch import PackedBatch, pack_sequences
from megatron_grpo.train.rollout_batch import RolloutBatch

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
    batch: RolloutBatch, idx: list[int], advantages: Tensor, pad_to_multiple_of: int
) -> PackedBatch:
    """Pack samples ``idx`` with their advantages ``[B]`` and rollout log-probs (if any)."""
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
        pad_to_multiple_of=pad_to_multiple_of,
    )


def make_mini_batches(
    batch: RolloutBatch,
    advantages: Tensor,
    num_mini_batches: int,
    micro_batch_size: int | None,
    max_tokens: int | None,
    pad_to_multiple_of: int = 1,
) -> list[list[PackedBatch]]:
    """Split the samples in order into ``num_mini_batches`` equal parts (one optimizer step
    each), then into packed micro-batches."""
    n = len(batch)
    if n % num_mini_batches:
        raise ValueError(
            f"this rank's {n} samples cannot be split into training.mini_batches_per_step="
            f"{num_mini_batches} equal mini-batches"
        )
    size = n // num_mini_batches
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
    out = []
    for start in range(0, n, size):
        rows = list(range(start, start + size))
        groups = micro_batch_indices([lengths[i] for i in rows], micro_batch_size, max_tokens)
        out.append(
            [
                pack_samples(batch, [rows[j] for j in g], advantages, pad_to_multiple_of)
                for g in groups
            ]
        )
    return out


def nonfinite_inputs(micro_batches: list[PackedBatch]) -> list[bool]:
    """For each name in ``PER_TOKEN_INPUTS``: does any micro-batch hold a non-finite value at a
    ``loss_mask`` position?"""
    flags = []
    for name in PER_TOKEN_INPUTS:
        bad = False
        for mb in micro_batches:
            x = getattr(mb, name)
            if x is not None and not bool(torch.isfinite(x[mb.loss_mask]).all()):
                bad = True
        flags.append(bad)
    return flags
