"""Decode graphs are captured again by every rank of their collectives or by none.

Capture runs the step eagerly before recording it, so a rank that re-captures alone issues
collectives its TP peer replays from a graph: they pair up wrongly and the group hangs (a TP2 x
DP2 run on 4 H100s hung in its third rollout this way).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _agree_body(rank: int, world: int) -> None:
    from megatron_grpo.rollout.engine.graphs import DecodeGraphs

    agree_recapture = DecodeGraphs.agree_recapture

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # "TP" groups
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # "expert" groups
    tp, ep = pairs[rank // 2], across[rank % 2]
    assert agree_recapture(rank == 0, [tp]) is (rank < 2)  # only rank 0's pair follows it
    assert agree_recapture(rank == 3, [None, tp]) is (rank >= 2)  # None: not a group
    assert agree_recapture(rank == 1, [tp, ep]) is True  # both groups: everyone
    assert agree_recapture(False, [tp, ep]) is False
    assert agree_recapture(True, []) is True  # one rank, no collectives: its own decision


def test_agree_recapture_over_the_graphs_groups():
    run_distributed(_agree_body, 4)


def _tp2_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, SamplingParams, generate
    from tests.megatron_utils import build_layout, tiny_model

    cfg = tiny_model(init_method_std=0.3)
    chunks = build_layout(ParallelConfig(tensor_model_parallel_size=2), cfg)
    model = unwrap(chunks[0])
    engine = KVCacheEngine(
        model, EngineOptions(kv_cache_gib=0.5, context_bucket=16, keep_cache=False)
    )
    assert engine.use_graphs
    params = SamplingParams(top_k=1, max_new_tokens=12, eos_id=3, vocab_size=cfg.vocab_size)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, cfg.vocab_size, (5 + i % 7,), generator=g).tolist() for i in range(24)
    ]
    first = generate(model, prompts, params, torch.Generator().manual_seed(1), engine=engine)
    captures = engine.graphs.captures
    # Rank 0's weight moves (same values), its TP peer's does not. (A hog taking the freed
    # cache's block did not move it: the cache is sized by the samples, 0.1 MiB here.)
    if rank == 0:
        weight = next(model.parameters())
        weight.data = weight.data.clone()
    again = generate(model, prompts, params, torch.Generator().manual_seed(1), engine=engine)
    assert again == first
    assert engine.graphs.captures > captures, f"rank {rank} replayed: the re-capture not agreed"


@pytest.mark.gpu
def test_gpu_tp2_ranks_recapture_together():
    """2 GPUs: one TP rank's weight moves between calls, its peer's does not; both re-capture
    and the second call finishes with the first call's greedy tokens (before: a hang)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(_tp2_body, 2, backend="nccl", timeout=90)
