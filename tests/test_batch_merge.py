"""Merged micro-batches for the no-grad log-prob passes (megatron/batch/merge.py): the merged
batch holds every sequence in order, and its log-probs cut back per batch equal those of the
separate batches (fp32, TP 2 + SP, where each batch is padded to the TP multiple)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep, ParallelConfig
from megatron_grpo.megatron.batch.merge import merge_groups, merge_packed, split_merged
from tests.dist_utils import run_distributed
from tests.megatron_utils import build_layout, make_sequences, pack, tiny_model


def _batches(multiple: int = 1):
    seqs = make_sequences(10, seed=3)
    return [pack(seqs[i : i + n], multiple) for i, n in ((0, 3), (3, 1), (4, 4), (8, 2))]


def test_merge_keeps_every_sequence_in_order():
    batches = _batches(multiple=4)
    merged = merge_packed(batches)
    for f in dataclasses.fields(merged):
        parts = [getattr(b, f.name) for b in batches]
        if f.name == "cu_seqlens":
            lens = torch.cat([cu[1:] - cu[:-1] for cu in parts])
            assert torch.equal(merged.cu_seqlens[1:] - merged.cu_seqlens[:-1], lens)
            assert merged.cu_seqlens.dtype == torch.int32 and int(merged.cu_seqlens[0]) == 0
        elif parts[0] is not None:
            assert torch.equal(getattr(merged, f.name), torch.cat(parts)), f.name
    merged.validate()
    assert merged.num_tokens % 4 == 0
    back = split_merged(torch.arange(merged.num_tokens), batches)
    assert [b.numel() for b in back] == [b.num_tokens for b in batches]
    assert merge_packed(batches[:1]) is batches[0]


def test_groups_respect_the_budget_and_the_carried_fields():
    batches = _batches()
    sizes = [b.num_tokens for b in batches]
    groups = merge_groups(batches, sizes[0] + sizes[1])
    assert groups[0] == [0, 1] and sum(groups, []) == list(range(len(batches)))
    for g in groups:
        assert len(g) == 1 or sum(sizes[i] for i in g) <= sizes[0] + sizes[1]
    assert merge_groups(batches, 1) == [[i] for i in range(len(batches))]
    assert merge_groups(batches, 10**6) == [list(range(len(batches)))]
    routed = dataclasses.replace(batches[1], routes=torch.zeros(sizes[1], 1, 1, dtype=torch.long))
    assert merge_groups([batches[0], routed, batches[2]], 10**6) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="different optional fields"):
        merge_packed([batches[0], routed])
    with pytest.raises(ValueError, match="max_tokens"):
        merge_groups(batches, 0)


def _model_body(rank: int, world: int, cp: bool = False) -> None:
    parallel = (
        ParallelConfig(context_parallel_size=2)
        if cp
        else ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    )
    chunks = build_layout(parallel, tiny_model())
    step = GRPOStep(GRPOLossConfig(), vocab_size=tiny_model().vocab_size)
    batches = _batches(multiple=2)
    want = step.compute_logprobs(chunks, batches)
    (merged,) = step.compute_logprobs(chunks, [merge_packed(batches)])
    for i, (got, ref) in enumerate(zip(split_merged(merged, batches), want, strict=True)):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6, msg=f"batch {i}")


@pytest.mark.parametrize("cp", [False, True], ids=["tp2_sp", "cp2"])
def test_merged_logprobs_equal_the_separate_batches(cp):
    run_distributed(_model_body, 2, cp)
