"""Context parallelism: sequences split over 2 gloo ranks give exactly the unsplit loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_grpo.loss import (
    GRPOLossConfig,
    global_denominators,
    grpo_loss,
    local_denominator,
    reduce_metrics,
)
from tests.dist_utils import run_distributed

LENGTHS = [6, 1, 9, 4]  # sequence 1 lives on CP rank 0 only (rank 1 holds an empty slot)
CONFIGS = [
    dict(kl_coef=0.1, is_correction_level="token", is_mask=(0.9, 1.1), entropy_coef=0.01),
    dict(ratio_level="sequence", is_correction_level="sequence", loss_agg="seq_mean_token_mean"),
    dict(
        ratio_level="sequence",
        is_correction_level="sequence",
        is_mask=(0.9, 1.1),
        is_mask_scope="pg",
        kl_coef=0.1,
        kl_gradient="unbiased",
        entropy_coef=0.01,
    ),
    dict(
        is_correction_level="sequence_mean",
        is_truncate=1.01,
        loss_agg="seq_mean_token_sum_norm",
        max_response_length=12,
    ),
]


def full_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    n = sum(LENGTHS)
    old = -torch.rand(n, generator=g) * 2
    mask = torch.rand(n, generator=g) > 0.2
    return dict(
        logprobs=old + 0.2 * torch.randn(n, generator=g),
        old_logprobs=old,
        advantages=torch.randn(n, generator=g),
        ref_logprobs=old + 0.1 * torch.randn(n, generator=g),
        rollout_logprobs=old + 0.1 * torch.randn(n, generator=g),
        entropy=torch.rand(n, generator=g),
        loss_mask=mask,
    )


def cp_shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of CP rank ``rank`` (first / second half of every sequence) and its cu_seqlens."""
    rows, lengths, start = [], [], 0
    for length in LENGTHS:
        half = (length + 1) // 2
        lo, hi = (start, start + half) if rank == 0 else (start + half, start + length)
        rows.append(torch.arange(lo, hi))
        lengths.append(hi - lo)
        start += length
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return torch.cat(rows), cu


def run_loss(cfg, x, cu, cp_group=None, denominator=None):
    lp = x["logprobs"].clone().requires_grad_(True)
    ent = x["entropy"].clone().requires_grad_(True)
    rest = {k: v for k, v in x.items() if k not in ("logprobs", "entropy")}
    loss, m = grpo_loss(
        cfg,
        logprobs=lp,
        entropy=ent,
        cu_seqlens=cu,
        cp_group=cp_group,
        denominator=denominator,
        **rest,
    )
    loss.backward()
    return loss.detach(), lp.grad, ent.grad, m


def _body(rank: int, world_size: int) -> None:
    group = dist.new_group(list(range(world_size)))
    full = full_batch()
    full_cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    rows, cu = cp_shard(rank)
    shard = {k: v[rows] for k, v in full.items()}
    for options in CONFIGS:
        cfg = GRPOLossConfig(**options)
        for denominator in (None, 7.0):
            want = run_loss(cfg, full, full_cu, denominator=denominator)
            loss, g, eg, m = run_loss(cfg, shard, cu, group, denominator)
            dist.all_reduce(loss, group=group)
            torch.testing.assert_close(loss, want[0], msg=f"{options} loss")
            torch.testing.assert_close(g, want[1][rows], msg=f"{options} logprobs grad")
            if cfg.entropy_coef:
                torch.testing.assert_close(eg, want[2][rows], msg=f"{options} entropy grad")
            else:
                assert eg is None and want[2] is None
            got, expect = reduce_metrics([m], group), reduce_metrics([want[3]])
            assert got == pytest.approx(expect), (options, got, expect)
        count = local_denominator(cfg, shard["loss_mask"], cu, group)
        dist.all_reduce(count, group=group)
        assert count.item() == local_denominator(cfg, full["loss_mask"], full_cu).item()
    denoms = global_denominators([shard["loss_mask"]], [cu], group=group, cp_group=group)
    assert denoms.tokens == full["loss_mask"].sum().item()
    seq_cfg = GRPOLossConfig(loss_agg="seq_mean_token_sum")
    assert denoms.sequences == local_denominator(seq_cfg, full["loss_mask"], full_cu).item()


@pytest.mark.slow
def test_cp_split_matches_unsplit():
    run_distributed(_body, 2)
