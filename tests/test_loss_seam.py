"""The fused-path seam: context once, objective per row chunk, summed == grpo_loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_grpo.loss import (
    GRPOLossConfig,
    build_context,
    grpo_loss,
    merge_metrics,
    objective,
    reduce_metrics,
)


def inputs(n: int = 23) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(n, generator=g) * 2
    mask = torch.rand(n, generator=g) > 0.25
    return dict(
        old_logprobs=old.bfloat16(),
        advantages=torch.randn(n, generator=g),
        loss_mask=mask,
        cu_seqlens=torch.tensor([0, 4, 11, 11, n], dtype=torch.int32),
        ref_logprobs=old + 0.1 * torch.randn(n, generator=g),
        rollout_logprobs=old + 0.05 * torch.randn(n, generator=g),
    )


CFG = GRPOLossConfig(
    kl_coef=0.05,
    entropy_coef=0.01,
    dual_clip_c=3.0,
    is_correction_level="sequence_mean",
    is_truncate=1.02,
    loss_agg="seq_mean_token_mean",
)


@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("kl_gradient", ["pathwise", "unbiased"])
def test_chunked_objective_equals_grpo_loss(chunk, kl_gradient):
    cfg = replace(CFG, kl_gradient=kl_gradient)
    x = inputs()
    g = torch.Generator().manual_seed(8)
    lp = (x["old_logprobs"].float() + 0.3 * torch.randn(23, generator=g)).requires_grad_(True)
    ent = torch.rand(23, generator=g).requires_grad_(True)
    loss, metrics = grpo_loss(cfg, logprobs=lp, entropy=ent, denominator=3.0, **x)
    loss.backward()
    full_grads = lp.grad.clone(), ent.grad.clone()
    lp.grad = ent.grad = None

    ctx = build_context(cfg, denominator=3.0, **x)
    total, pieces = torch.zeros(()), [ctx.metrics]
    for start in range(0, ctx.num_rows, chunk):
        part = ctx.rows(slice(start, start + chunk))
        value, m = objective(cfg, part, lp[part.index], ent[part.index])
        total, pieces = total + value, pieces + [m]
    total.backward()
    assert total.item() == pytest.approx(loss.item(), abs=1e-6)
    torch.testing.assert_close((lp.grad, ent.grad), full_grads)
    assert reduce_metrics(pieces) == pytest.approx(reduce_metrics([metrics]))
    assert merge_metrics(pieces).keys() == metrics.keys()


def test_rows_accepts_an_index_tensor_and_keeps_context_metrics_out():
    ctx = build_context(CFG, **inputs())
    part = ctx.rows(torch.tensor([0, 2]))
    assert part.num_rows == 2 and part.metrics == {} and not part.complete
    assert torch.equal(part.index, ctx.index[[0, 2]])


def test_sequence_ratio_needs_the_full_context():
    cfg = GRPOLossConfig(ratio_level="sequence")
    ctx = build_context(cfg, **{k: v for k, v in inputs().items() if "ref" not in k})
    lp = ctx.old.clone()
    objective(cfg, ctx, lp)  # full context is fine
    with pytest.raises(ValueError, match="ratio_level='sequence'"):
        objective(cfg, ctx.rows(slice(0, 3)), lp[:3])


def test_objective_checks_its_inputs():
    ctx = build_context(CFG, **inputs())
    with pytest.raises(ValueError, match=r"logprobs must have shape \[T\]"):
        objective(CFG, ctx, torch.zeros(ctx.num_rows + 1), torch.zeros(ctx.num_rows))
    with pytest.raises(ValueError, match="entropy is required"):
        objective(CFG, ctx, torch.zeros(ctx.num_rows))
