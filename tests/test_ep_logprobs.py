"""No-grad log-prob passes at EP 2: merged micro-batches equal unmerged ones (and EP 1), the
ranks agree on the number of forwards by one all-reduce, and a rank with fewer micro-batches
runs extra forwards instead of leaving the others in a collective. The distributed check runs
in ``tests/test_ep_dispatch.py``'s EP 2 generation spawn (the same two models)."""

from __future__ import annotations

import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep
from megatron_grpo.megatron.batch.merge import match_count
from tests.megatron_utils import assert_close, make_sequences, pack


def test_match_count_splits_then_adds_forwards():
    assert match_count([[0, 1, 2], [3]], 2) == ([[0, 1, 2], [3]], 0)
    assert match_count([[0, 1, 2], [3]], 3) == ([[0], [1, 2], [3]], 0)
    assert match_count([[0, 1], [2]], 5) == ([[0], [1], [2]], 2)
    assert match_count([[0]], 1) == ([[0]], 0)


def check_merged_logprobs(rank: int, ref: list, chunks: list, cfg) -> None:
    """``ref`` (EP 1) and ``chunks`` (EP 2, the same weights; run in the generation test's
    spawn): merged passes equal unmerged ones and EP 1, rank 1 holding fewer micro-batches."""
    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    seqs = make_sequences(6, seed=9 + rank)
    # rank 0: three micro-batches, rank 1: one (fewer forwards than its expert-parallel peer)
    batches = [pack(seqs[:2]), pack(seqs[2:4]), pack(seqs[4:])] if rank == 0 else [pack(seqs)]
    want = step.compute_logprobs(ref, batches)  # EP 1: no collective in the MoE layers
    group = torch.distributed.group.WORLD
    for max_tokens in (None, 10**6, 20):  # unmerged (extra forwards), all merged, some merged
        got = step.compute_logprobs(chunks, batches, max_tokens, count_group=group)
        assert len(got) == len(batches)
        for a, b in zip(got, want, strict=True):
            assert_close(f"logprobs (max_tokens={max_tokens})", a, b, tol=1e-5)
