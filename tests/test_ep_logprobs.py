"""No-grad log-prob passes at EP 2: merged micro-batches equal unmerged ones (and EP 1), the
ranks agree on the number of forwards by one all-reduce, and a rank with fewer micro-batches
runs extra forwards instead of leaving the others in a collective."""

from __future__ import annotations

import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep, ParallelConfig
from megatron_grpo.megatron.batch.merge import match_count
from tests.dist_utils import run_distributed
from tests.ep_utils import cpu_alltoall
from tests.megatron_utils import (
    assert_close,
    build_layout,
    full_params,
    load_full,
    make_sequences,
    pack,
    tiny_model,
)


def test_match_count_splits_then_adds_forwards():
    assert match_count([[0, 1, 2], [3]], 2) == ([[0, 1, 2], [3]], 0)
    assert match_count([[0, 1, 2], [3]], 3) == ([[0], [1, 2], [3]], 0)
    assert match_count([[0, 1], [2]], 5) == ([[0], [1], [2]], 2)
    assert match_count([[0]], 1) == ([[0]], 0)


def _body(rank: int, world: int) -> None:
    cpu_alltoall()
    cfg = tiny_model(
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall", num_layers=2,
    )  # fmt: skip
    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    seqs = make_sequences(6, seed=9 + rank)
    # rank 0: three micro-batches, rank 1: one (fewer forwards than its expert-parallel peer)
    batches = [pack(seqs[:2]), pack(seqs[2:4]), pack(seqs[4:])] if rank == 0 else [pack(seqs)]
    ref = build_layout(ParallelConfig(), cfg)  # EP 1: no collective in the MoE layers
    weights = full_params(ref)
    want = step.compute_logprobs(ref, batches)
    chunks = build_layout(ParallelConfig(expert_model_parallel_size=2), cfg)
    load_full(chunks, weights, cfg)
    group = torch.distributed.group.WORLD
    for max_tokens in (None, 10**6, 20):  # unmerged (extra forwards), all merged, some merged
        got = step.compute_logprobs(chunks, batches, max_tokens, count_group=group)
        assert len(got) == len(batches)
        for a, b in zip(got, want, strict=True):
            assert_close(f"logprobs (max_tokens={max_tokens})", a, b, tol=1e-5)


def test_merged_logprobs_at_ep2_equal_unmerged_and_uneven_counts_do_not_hang():
    run_distributed(_body, 2, timeout=300)
