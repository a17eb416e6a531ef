"""Reduction: gradients and metrics independent of the micro-batch split; denominators."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.loss import (
    GRPOLossConfig,
    MaxMetric,
    MeanMetric,
    MinMetric,
    SumMetric,
    global_denominators,
    grpo_loss,
    local_denominator,
    reduce_metrics,
)

LENGTHS = [5, 1, 7, 3, 4, 6]  # six sequences; micro-batches: [0, 1], [2, 3, 4], [5]
SPLITS = [(0, 2), (2, 5), (5, 6)]
CONFIGS = [
    dict(loss_agg="token_mean", kl_coef=0.1, is_correction_level="token", is_truncate=1.05),
    dict(loss_agg="seq_mean_token_mean", ratio_level="sequence", is_correction_level="sequence"),
    dict(loss_agg="seq_mean_token_sum", is_correction_level="sequence_mean", is_mask=(0.97, 1.03)),
    dict(loss_agg="seq_mean_token_sum_norm", max_response_length=16, entropy_coef=0.01),
]


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    old = -torch.rand(n, generator=g) * 2
    mask = torch.rand(n, generator=g) > 0.3
    mask[5] = False  # the one-token sequence 1 has no valid token
    return dict(
        logprobs=old + 0.3 * torch.randn(n, generator=g),
        old_logprobs=old,
        advantages=torch.randn(n, generator=g),
        ref_logprobs=old + 0.1 * torch.randn(n, generator=g),
        rollout_logprobs=old + 0.05 * torch.randn(n, generator=g),
        entropy=torch.rand(n, generator=g),
        loss_mask=mask,
    )


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def micro_batches(full: dict[str, torch.Tensor]):
    starts = cu_of(LENGTHS).tolist()
    for a, b in SPLITS:
        rows = slice(starts[a], starts[b])
        yield {k: v[rows] for k, v in full.items()}, cu_of(LENGTHS[a:b])


def loss_and_grad(cfg, inputs, cu, denominator):
    lp = inputs["logprobs"].clone().requires_grad_(True)
    rest = {k: v for k, v in inputs.items() if k != "logprobs"}
    loss, metrics = grpo_loss(cfg, logprobs=lp, cu_seqlens=cu, denominator=denominator, **rest)
    loss.backward()
    return loss, lp.grad, metrics


@pytest.mark.parametrize("options", CONFIGS)
def test_gradient_is_invariant_to_the_micro_batch_split(options):
    cfg = GRPOLossConfig(**options)
    full = make_batch()
    full_loss, full_grad, full_m = loss_and_grad(cfg, full, cu_of(LENGTHS), None)
    parts = list(micro_batches(full))
    denoms = global_denominators([p["loss_mask"] for p, _ in parts], [cu for _, cu in parts])
    assert denoms.tokens == full["loss_mask"].sum().item()
    assert denoms.sequences == 5  # sequence 1 has no valid token: not counted
    results = [loss_and_grad(cfg, p, cu, denoms.for_loss(cfg)) for p, cu in parts]
    assert sum(r[0].item() for r in results) == pytest.approx(full_loss.item(), abs=1e-6)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), full_grad)
    merged = reduce_metrics([r[2] for r in results])
    assert merged == pytest.approx(reduce_metrics([full_m]))

    # Megatron's per-token path: denominator=1, local counts summed, gradients divided by it.
    summed = [loss_and_grad(cfg, p, cu, 1.0) for p, cu in parts]
    count = sum(local_denominator(cfg, p["loss_mask"], cu) for p, cu in parts)
    assert count.item() == denoms.for_loss(cfg)
    grad = torch.cat([r[1] for r in summed]) / count
    torch.testing.assert_close(grad, full_grad)


def test_seed_003_token_mean_is_not_a_mean_of_means():
    # micro-batch 1: 100 tokens with per-token loss 0.5; micro-batch 2: 900 tokens with 0.3
    cfg = GRPOLossConfig()
    masks = [torch.ones(100, dtype=torch.bool), torch.ones(900, dtype=torch.bool)]
    cus = [torch.tensor([0, 100]), torch.tensor([0, 900])]
    denom = global_denominators(masks, cus).for_loss(cfg)
    total = 0.0
    for mask, cu, value in zip(masks, cus, (0.5, 0.3), strict=True):
        n = mask.numel()
        loss, _ = grpo_loss(
            cfg,
            logprobs=torch.zeros(n),
            old_logprobs=torch.zeros(n),
            advantages=torch.full((n,), -value),  # ratio 1: pg = -A
            loss_mask=mask,
            cu_seqlens=cu,
            denominator=denom,
        )
        total += loss.item()
    assert total == pytest.approx(0.32, abs=1e-6)


def test_local_denominator_counts():
    mask = torch.tensor([1, 0, 0, 0, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 2, 4, 6, 6])
    assert local_denominator(GRPOLossConfig(), mask, cu).item() == 3
    assert local_denominator(GRPOLossConfig(loss_agg="seq_mean_token_sum"), mask, cu).item() == 2


def test_metric_classes_merge_exactly():
    a = MeanMetric.of(torch.tensor([1.0, 2.0]))
    b = MeanMetric.of(torch.tensor([6.0]))
    empty = MinMetric.of(torch.empty(0))
    out = reduce_metrics(
        [
            {"m": a, "lo": MinMetric.of(torch.tensor([3.0])), "s": SumMetric(2.0)},
            {"m": b, "lo": empty, "hi": MaxMetric.of(torch.tensor([-1.0, 4.0])), "s": SumMetric(1)},
            {"none": MeanMetric.of(torch.empty(0)), "never": empty},
        ]
    )
    assert out["m"] == 3.0 and out["lo"] == 3.0 and out["hi"] == 4.0 and out["s"] == 3.0
    assert out["none"] != out["none"] and out["never"] != out["never"]  # NaN when empty
    with pytest.raises(TypeError, match="'m'"):
        reduce_metrics([{"m": a}, {"m": SumMetric(1.0)}])
