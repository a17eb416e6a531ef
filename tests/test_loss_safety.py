"""NaN safety: masked garbage, huge log-ratios, long-sequence IS weights, non-finite policies."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig, grpo_loss, reduce_metrics

ALL_ON = dict(kl_coef=0.1, entropy_coef=0.01, dual_clip_c=3.0, is_truncate=2.0)
LEVELS = [
    dict(ratio_level="token", is_correction_level="token", is_mask=(0.1, 10.0)),
    dict(ratio_level="sequence", is_correction_level="sequence", loss_agg="seq_mean_token_mean"),
    dict(ratio_level="token", is_correction_level="sequence_mean", loss_agg="seq_mean_token_sum"),
]


def batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g) * 3
    return dict(
        logprobs=old + 0.1 * torch.randn(n, generator=g),
        old_logprobs=old,
        advantages=torch.randn(n, generator=g),
        ref_logprobs=old + 0.1 * torch.randn(n, generator=g),
        rollout_logprobs=old + 0.1 * torch.randn(n, generator=g),
        entropy=torch.rand(n, generator=g),
    )


def call(cfg, inputs, mask, cu):
    lp = inputs["logprobs"].clone().requires_grad_(True)
    ent = inputs["entropy"].clone().requires_grad_(True)
    rest = {k: v for k, v in inputs.items() if k not in ("logprobs", "entropy")}
    loss, m = grpo_loss(cfg, logprobs=lp, entropy=ent, loss_mask=mask, cu_seqlens=cu, **rest)
    loss.backward()
    return loss, m, lp.grad, ent.grad


@pytest.mark.parametrize("level", LEVELS)
def test_masked_nonfinite_never_reach_loss_or_grad(level):
    cfg = GRPOLossConfig(**ALL_ON, **level)
    n, cu = 12, torch.tensor([0, 5, 12])
    mask = torch.tensor([1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    clean = batch(n)
    dirty = {k: v.clone() for k, v in clean.items()}
    for k, v in dirty.items():
        v[~mask] = torch.tensor([math.inf, -math.inf, math.nan, 1e38])[: int((~mask).sum())]
        if k == "advantages":
            v[~mask] = math.nan
    ref_loss, ref_m, ref_g, ref_eg = call(cfg, clean, mask, cu)
    loss, m, g, eg = call(cfg, dirty, mask, cu)
    assert torch.isfinite(loss)
    assert loss.item() == ref_loss.item()
    assert torch.equal(g, ref_g) and torch.equal(eg, ref_eg)
    assert (g[~mask] == 0).all() and (eg[~mask] == 0).all()
    assert g[mask].abs().sum() > 0
    assert reduce_metrics([m]) == reduce_metrics([ref_m])


@pytest.mark.parametrize("level", LEVELS)
def test_log_ratios_of_200_stay_finite(level):
    cfg = GRPOLossConfig(**ALL_ON, **level)
    n = 8
    signs = torch.tensor([1.0, -1.0] * (n // 2))
    old = torch.full((n,), -1.0)
    inputs = dict(
        logprobs=old + 200 * signs,
        old_logprobs=old,
        advantages=torch.tensor([1.0, -1.0, -1.0, 1.0] * (n // 4)),
        ref_logprobs=old - 200 * signs,
        rollout_logprobs=old + 200 * signs.flip(0),
        entropy=torch.rand(n),
    )
    loss, m, g, eg = call(cfg, inputs, torch.ones(n, dtype=torch.bool), torch.tensor([0, 3, n]))
    assert torch.isfinite(loss) and torch.isfinite(g).all() and torch.isfinite(eg).all()
    values = reduce_metrics([m])
    assert all(math.isfinite(v) for v in values.values()), values
    assert values["loss/ratio_max"] <= math.exp(20.0) * (1 + 1e-6)


def test_log_ratio_clamp_none_disables_the_clamp():
    cfg = GRPOLossConfig(log_ratio_clamp=None)
    inputs = batch(2)
    inputs["logprobs"] = inputs["old_logprobs"] + torch.tensor([30.0, 0.0])
    _, m, _, _ = call(cfg, inputs, torch.ones(2, dtype=torch.bool), torch.tensor([0, 2]))
    assert reduce_metrics([m])["loss/ratio_max"] == pytest.approx(math.exp(30.0), rel=1e-5)


def test_long_sequence_is_weights_sum_collapses_mean_does_not():
    # 9000-token sequences, per-token mismatch log(old/rollout) ~ N(-s2/2, s2) with s2 = 0.02
    # (the -s2/2 shift makes each token's weight unbiased, E[w] = 1, as for rollout samples).
    g = torch.Generator().manual_seed(0)
    n_seq, length, var = 4, 9000, 0.02
    n = n_seq * length
    delta = -var / 2 + math.sqrt(var) * torch.randn(n, generator=g)
    old = -torch.rand(n, generator=g)
    cu = torch.arange(0, n + 1, length)
    weights = {}
    for level in ("sequence", "sequence_mean"):
        cfg = GRPOLossConfig(is_correction_level=level)
        _, m = grpo_loss(
            cfg,
            logprobs=old,
            old_logprobs=old,
            advantages=torch.ones(n),
            loss_mask=torch.ones(n, dtype=torch.bool),
            cu_seqlens=cu,
            rollout_logprobs=old - delta,
        )
        weights[level] = reduce_metrics([m])
    seq, mean = weights["sequence"], weights["sequence_mean"]
    assert seq["is/weight_max"] < 1e-6  # exp(sum) collapses (and stays finite: clamped at -20)
    assert seq["is/weight_min"] >= math.exp(-20.0) * (1 - 1e-6)
    assert 0.97 < mean["is/weight_min"] <= mean["is/weight_max"] < 1.01


def _nonfinite_inputs():
    inputs = batch(6, seed=3)
    inputs["old_logprobs"][1] = math.nan
    inputs["rollout_logprobs"][4] = -math.inf
    return inputs


@pytest.mark.parametrize("name", ["old_logprobs", "advantages", "ref_logprobs", "logprobs"])
def test_unmasked_nonfinite_raises_naming_the_tensor(name):
    inputs = batch(6)
    inputs[name][2] = math.inf
    mask, cu = torch.ones(6, dtype=torch.bool), torch.tensor([0, 6])
    with pytest.raises(ValueError, match=name):
        call(GRPOLossConfig(kl_coef=0.1), inputs, mask, cu)


def test_count_mode_drops_and_counts_nonfinite_tokens():
    mask, cu = torch.ones(6, dtype=torch.bool), torch.tensor([0, 3, 6])
    cfg = GRPOLossConfig(nonfinite="count", is_correction_level="token", kl_coef=0.1)
    loss, m, g, _ = call(cfg, _nonfinite_inputs(), mask, cu)
    clean_mask = mask.clone()
    clean_mask[[1, 4]] = False
    ref_loss, _, ref_g, _ = call(cfg, batch(6, seed=3), clean_mask, cu)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-7)
    assert torch.equal(g, ref_g)
    assert reduce_metrics([m])["loss/nonfinite_count"] == 2.0


def test_count_mode_neutralises_nonfinite_logprobs():
    inputs = batch(4, seed=5)
    inputs["logprobs"][2] = math.nan
    cfg = GRPOLossConfig(nonfinite="count")
    loss, m, g, _ = call(cfg, inputs, torch.ones(4, dtype=torch.bool), torch.tensor([0, 4]))
    assert torch.isfinite(loss) and g[2] == 0 and torch.isfinite(g).all()
    assert reduce_metrics([m])["loss/nonfinite_count"] == 1.0
