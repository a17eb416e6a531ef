"""Context parallelism: sequences split over 2 gloo ranks give exactly the unsplit loss; and
GSPO through ``fused_grpo_loss`` (its tiled path, whose gradients cross the CP all-reduce of the
sequence sums) equals the op path (``vocab_parallel_logprobs`` + ``grpo_loss``) on the same
split, and the unsplit result."""

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
from megatron_grpo.ops import fused_grpo_loss, vocab_parallel_logprobs
from tests.dist_utils import run_distributed
from tests.test_fused_grpo import ran_path
from tests.test_logprobs import close, make_inputs

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


def head_problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """hidden [n, H], weight [V, H], targets [n] and loss inputs near the current policy."""
    n, g = sum(LENGTHS), torch.Generator().manual_seed(13)
    hidden, weight, targets = make_inputs(n, 8, 24, seed=3)
    with torch.no_grad():
        logp = vocab_parallel_logprobs(hidden, weight, targets, impl="torch")
    noise = 0.2 * torch.randn(3, n, generator=g)
    old = logp + noise[0]
    batch = dict(old_logprobs=old, advantages=torch.randn(n, generator=g),
                 ref_logprobs=logp + noise[1], rollout_logprobs=old + 0.5 * noise[2],
                 loss_mask=full_batch()["loss_mask"])  # fmt: skip
    return hidden, weight, targets, batch


def fused_and_op(cfg, hidden, weight, targets, batch, cu, cp_group=None) -> list[tuple]:
    """(loss, metrics, logp, d_hidden, d_weight) of fused_grpo_loss (the plan's path: tiled),
    then of the op + grpo_loss; d_weight lands in an fp32 main_grad (Megatron's buffer)."""
    out = []
    for fused in (True, False):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        w.main_grad, w.grad_added_to_main_grad = torch.zeros(w.shape), False
        args = dict(batch, cu_seqlens=cu, cp_group=cp_group)
        if fused:
            loss, m, lp = fused_grpo_loss(h, w, targets, cfg, impl="torch", chunk_size=4, **args)
            assert ran_path(loss) == "tiled"
        else:
            ent = cfg.entropy_coef != 0
            out_op = vocab_parallel_logprobs(h, w, targets, rows=batch["loss_mask"], impl="torch",
                                             chunk_size=4, return_entropy=ent)  # fmt: skip
            lp, en = out_op if ent else (out_op, None)
            loss, m = grpo_loss(cfg, logprobs=lp, entropy=en, **args)
        loss.backward()
        assert w.grad_added_to_main_grad
        out.append((loss.detach(), m, lp.detach(), h.grad, w.main_grad))
    return out


def _check_fused_gspo(rank: int, group, full_cu: torch.Tensor) -> None:
    """GSPO (sequence IS; with masking, KL and entropy) on this rank's CP rows: fused == op, and
    their CP sums / slices == the unsplit run (sequences ``full_cu``)."""
    hidden, weight, targets, batch = head_problem()
    rows, cu = cp_shard(rank)
    shard = {k: v[rows] for k, v in batch.items()}
    for options in CONFIGS[1:3]:
        cfg = GRPOLossConfig(**options)
        fused, op = fused_and_op(cfg, hidden[rows], weight, targets[rows], shard, cu, group)
        full = fused_and_op(cfg, hidden, weight, targets, batch, full_cu)[0]
        assert reduce_metrics([fused[1]], group) == pytest.approx(reduce_metrics([op[1]], group))
        assert reduce_metrics([fused[1]], group) == pytest.approx(reduce_metrics([full[1]]))
        for i in (0, 2, 3, 4):
            close(fused[i], op[i], rtol=1e-5, atol=1e-7)
        for t in (fused[0], fused[4]):
            dist.all_reduce(t, group=group)
        close(fused[0], full[0], rtol=1e-5, atol=1e-7)
        close(fused[2], full[2][rows])
        close(fused[3], full[3][rows], rtol=1e-5, atol=1e-7)
        close(fused[4], full[4], rtol=1e-5, atol=1e-7)


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
    _check_fused_gspo(rank, group, full_cu)


@pytest.mark.slow
def test_cp_split_matches_unsplit():
    run_distributed(_body, 2)
