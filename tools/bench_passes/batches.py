"""The packed micro-batches of a row: ``--micro-batches`` x ``--tokens`` tokens of documents
of L tokens (or ``--mixed`` LO-HI lengths), prompt = the first half, response = the second."""

from __future__ import annotations

import torch

from megatron_grpo.megatron import PackedBatch, pack_sequences

from .dist import RANK


def doc_lens(L: int | str, tokens: int, g: torch.Generator) -> list[int]:
    """Document lengths filling ``tokens``: all L (the last one cut), or for "LO-HI" uniform
    in [LO, HI]."""
    if isinstance(L, int):
        return [L] * (tokens // L) + ([tokens % L] if tokens % L else [])
    lo, hi = (int(x) for x in L.split("-"))
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(int(torch.randint(lo, hi + 1, (1,), generator=g)), tokens - sum(lens)))
    return lens


def batch_seed(L: int | str, args, rank: int = RANK) -> int:
    """The batches' seed; each rank its own (data-parallel ranks hold different data)."""
    return args.seed + (L if isinstance(L, int) else 7919) + 100003 * rank


def make_batches(L: int | str, args, seed: int) -> list[PackedBatch]:
    """``--micro-batches`` packed batches of ``--tokens`` tokens: documents of L tokens (or of
    ``--mixed`` lengths, new ones in each micro-batch)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(args.micro_batches):
        lens = doc_lens(L, args.tokens, g)
        seqs = [torch.randint(0, args.vocab, (n,), generator=g) for n in lens]
        masks = [torch.arange(n) >= n // 2 for n in lens]
        old = [-(torch.rand(n, generator=g) * 2 + 0.1) for n in lens]
        ref = [o - 0.05 * torch.rand(n, generator=g) for o, n in zip(old, lens, strict=True)]
        adv = torch.randn(len(lens), generator=g)
        batches.append(pack_sequences(seqs, masks, advantages=adv, old_logprobs=old,
                                      ref_logprobs=ref, pad_to_multiple_of=args.tp_size))  # fmt: skip
    return batches


def set_old_logprobs(batches: list[PackedBatch], logprobs: list[torch.Tensor], seed: int) -> None:
    """What the trainer does with the log-prob pass: old = its output, here ref = old + noise."""
    g = torch.Generator().manual_seed(seed)
    for b, lp in zip(batches, logprobs, strict=True):
        b.old_logprobs = lp.float()
        b.ref_logprobs = lp.float() - 0.05 * torch.rand(lp.shape, generator=g)
