"""Hand-computed loss values and gradients, one option at a time."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig, grpo_loss, reduce_metrics

LN = math.log


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def run(cfg, log_ratio, adv, *, cu=None, mask=None, old=None, grad=False, **kw):
    """Loss with ``logprobs = old + log_ratio``; returns (loss, metrics, d loss / d logprobs)."""
    n = len(log_ratio)
    old = torch.zeros(n) if old is None else t(old)
    lp = (old + t(log_ratio)).requires_grad_(True)
    mask = torch.ones(n, dtype=torch.bool) if mask is None else torch.tensor(mask)
    cu = torch.tensor([0, n]) if cu is None else torch.tensor(cu)
    kw = {k: (t(v) if isinstance(v, list) else v) for k, v in kw.items()}
    loss, metrics = grpo_loss(
        cfg, logprobs=lp, old_logprobs=old, advantages=t(adv), loss_mask=mask, cu_seqlens=cu, **kw
    )
    loss.backward()
    return loss.item(), reduce_metrics([metrics]), lp.grad


def test_token_ppo_clip():
    # ratios 1.5 (A=1, clipped high), 0.5 (A=-1, clipped low), 1.1 (A=-1), 1.0 (A=2)
    loss, m, g = run(GRPOLossConfig(), [LN(1.5), LN(0.5), LN(1.1), 0.0], [1, -1, -1, 2])
    assert loss == pytest.approx((-1.2 + 0.8 + 1.1 - 2.0) / 4, abs=1e-6)
    assert g.tolist() == pytest.approx([0.0, 0.0, 1.1 / 4, -2.0 / 4], abs=1e-6)
    assert m["loss/pg_clipfrac_low"] == pytest.approx(0.25)
    assert m["loss/pg_clipfrac_high"] == pytest.approx(0.25)
    assert m["loss/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.0) / 4, rel=1e-6)
    assert m["loss/ratio_min"] == pytest.approx(0.5, rel=1e-6)
    assert m["loss/ratio_max"] == pytest.approx(1.5, rel=1e-6)
    assert "loss/pg_clipfrac_dual" not in m


def test_asymmetric_clip_higher():
    cfg = GRPOLossConfig(clip_eps_low=0.1, clip_eps_high=0.28)
    loss, _, _ = run(cfg, [LN(1.5), LN(0.5)], [1, -1])
    assert loss == pytest.approx((-1.28 + 0.9) / 2, abs=1e-6)


def test_dual_clip():
    cfg = GRPOLossConfig(dual_clip_c=3.0)
    # A=-1: ratio 5 -> unclipped 5 bounded by c*|A| = 3; ratio 2 -> 2 (below the bound)
    loss, m, g = run(cfg, [LN(5.0), LN(2.0), LN(5.0)], [-1, -1, 1])
    assert loss == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-6)
    assert g.tolist() == pytest.approx([0.0, 2.0 / 3, 0.0], abs=1e-6)
    assert m["loss/pg_clipfrac_dual"] == pytest.approx(1 / 3)


def test_gspo_sequence_ratio():
    cfg = GRPOLossConfig(ratio_level="sequence")
    # seq0 valid log-ratios 0.05, 0.15 (the masked 9.0 is ignored) -> s0 = e^0.1, A=1
    # seq1 log-ratios -0.3, 0.1, 0.2 -> s1 = 1, A=-1 -> pg 1
    lr = [0.05, 9.0, 0.15, -0.3, 0.1, 0.2]
    mask = [True, False, True, True, True, True]
    loss, m, g = run(cfg, lr, [1, 1, 1, -1, -1, -1], cu=[0, 3, 6], mask=mask)
    s0 = math.exp(0.1)
    assert loss == pytest.approx((-2 * s0 + 3.0) / 5, abs=1e-6)
    # d/d lp_t of 2 * (-s0)/5 with ds0/dlp_t = s0 / 2; seq1: 3/5 * s1 / 3
    expect = [-s0 / 5, 0.0, -s0 / 5, 1 / 5, 1 / 5, 1 / 5]
    assert g.tolist() == pytest.approx(expect, abs=1e-6)
    assert m["loss/ratio_max"] == pytest.approx(s0, rel=1e-6)


@pytest.mark.parametrize(
    "estimator,value,dvalue",
    [
        ("k1", lambda x: -x, lambda x: 1.0),
        ("k2", lambda x: x * x / 2, lambda x: -x),
        ("k3", lambda x: math.exp(x) - 1 - x, lambda x: -(math.exp(x) - 1)),
    ],
)
def test_kl_estimators(estimator, value, dvalue):
    cfg = GRPOLossConfig(kl_coef=0.5, kl_estimator=estimator)
    xs = [0.5, -1.0]  # x = ref - logp; logp = 0, A = 0 so only the KL term remains
    loss, m, g = run(cfg, [0.0, 0.0], [0, 0], ref_logprobs=xs)
    assert loss == pytest.approx(0.5 * sum(value(x) for x in xs) / 2, abs=1e-6)
    assert g.tolist() == pytest.approx([0.5 * dvalue(x) / 2 for x in xs], abs=1e-6)
    assert m["loss/kl_mean"] == pytest.approx(sum(value(x) for x in xs) / 2, abs=1e-6)


def test_kl_clamps():
    xs = [30.0, -30.0, 5.0]
    _, m, _ = run(GRPOLossConfig(kl_coef=1.0), [0.0] * 3, [0] * 3, ref_logprobs=xs)
    # k3(30) -> e^20 - 21 -> 10; k3(-30) -> e^-20 + 19 -> 10; k3(5) = e^5 - 6 -> 10
    assert m["loss/kl_mean"] == pytest.approx(10.0)
    cfg = GRPOLossConfig(kl_coef=1.0, kl_input_clamp=2.0, kl_output_clamp=None)
    _, m, _ = run(cfg, [0.0] * 3, [0] * 3, ref_logprobs=xs)
    expect = (math.exp(2) - 3) * 2 + (math.exp(-2) + 1)
    assert m["loss/kl_mean"] == pytest.approx(expect / 3, rel=1e-6)
    cfg = GRPOLossConfig(kl_coef=1.0, kl_input_clamp=None, kl_output_clamp=None)
    _, m, _ = run(cfg, [0.0], [0], ref_logprobs=[5.0])
    assert m["loss/kl_mean"] == pytest.approx(math.exp(5) - 6, rel=1e-6)


def test_kl_metric_without_penalty_has_no_gradient():
    loss, m, g = run(GRPOLossConfig(), [0.0, 0.0], [0, 0], ref_logprobs=[0.5, -1.0])
    assert loss == 0.0 and g.abs().sum() == 0
    assert m["loss/kl_mean"] == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-1)) / 2)


def test_is_token_truncate_and_mask():
    rollout = [-LN(2.0), -LN(0.5), 0.0]  # old = 0 -> weights 2, 0.5, 1
    base = GRPOLossConfig(is_correction_level="token")
    loss, m, g = run(base, [0.0] * 3, [1, 1, 1], rollout_logprobs=rollout)
    assert loss == pytest.approx(-(2 + 0.5 + 1) / 3, abs=1e-6)
    assert g.tolist() == pytest.approx([-2 / 3, -0.5 / 3, -1 / 3], abs=1e-6)
    assert (m["is/weight_mean"], m["is/weight_min"], m["is/weight_max"]) == pytest.approx(
        (3.5 / 3, 0.5, 2.0)
    )
    tis = GRPOLossConfig(is_correction_level="token", is_truncate=1.5)
    loss, m, _ = run(tis, [0.0] * 3, [1, 1, 1], rollout_logprobs=rollout)
    assert loss == pytest.approx(-(1.5 + 0.5 + 1) / 3, abs=1e-6)
    assert m["is/frac_truncated"] == pytest.approx(1 / 3)
    mis = GRPOLossConfig(is_correction_level="token", is_mask=(0.6, 1.8))
    loss, m, g = run(mis, [0.0] * 3, [1, 1, 1], rollout_logprobs=rollout)
    assert loss == pytest.approx(-1 / 3, abs=1e-6)  # dropped tokens stay in the count
    assert g.tolist() == pytest.approx([0.0, 0.0, -1 / 3], abs=1e-6)
    assert m["is/frac_masked"] == pytest.approx(2 / 3)


def test_is_sequence_levels():
    rollout = [-0.1, -0.2, 0.4]  # old = 0: seq0 log-weights 0.1, 0.2; seq1 -0.4
    kw = dict(cu=[0, 2, 3], rollout_logprobs=rollout)
    seq = GRPOLossConfig(is_correction_level="sequence")
    loss, _, _ = run(seq, [0.0] * 3, [1, 1, 1], **kw)
    assert loss == pytest.approx(-(2 * math.exp(0.3) + math.exp(-0.4)) / 3, abs=1e-6)
    mean = GRPOLossConfig(is_correction_level="sequence_mean")
    loss, _, _ = run(mean, [0.0] * 3, [1, 1, 1], **kw)
    assert loss == pytest.approx(-(2 * math.exp(0.15) + math.exp(-0.4)) / 3, abs=1e-6)
    mis = GRPOLossConfig(is_correction_level="sequence", is_mask=(0.8, 2.0))
    loss, m, _ = run(mis, [0.0] * 3, [1, 1, 1], **kw)
    assert loss == pytest.approx(-2 * math.exp(0.3) / 3, abs=1e-6)  # seq1 (0.67) dropped
    assert m["is/frac_masked"] == pytest.approx(1 / 3)


def test_is_weight_multiplies_pg_only():
    cfg = GRPOLossConfig(is_correction_level="token", kl_coef=1.0, kl_estimator="k1")
    loss, _, _ = run(cfg, [0.0], [0], rollout_logprobs=[-LN(4.0)], ref_logprobs=[0.5])
    assert loss == pytest.approx(-0.5, abs=1e-6)  # k1 = -x, not scaled by the weight 4


def test_mismatch_metrics():
    _, m, _ = run(GRPOLossConfig(), [0.0, 0.0], [0, 0], rollout_logprobs=[-0.5, 0.5])
    assert m["mismatch/k1"] == pytest.approx(0.0, abs=1e-7)
    k3 = (math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 2
    assert m["mismatch/k3"] == pytest.approx(k3, rel=1e-6)


@pytest.mark.parametrize(
    "agg,expect",
    [
        ("token_mean", -(2 + 3) / 4),
        ("seq_mean_token_mean", -(2 / 1 + 3 / 3) / 2),
        ("seq_mean_token_sum", -(2 + 3) / 2),
        ("seq_mean_token_sum_norm", -(2 + 3) / (2 * 8)),
    ],
)
def test_loss_agg(agg, expect):
    cfg = GRPOLossConfig(
        loss_agg=agg, max_response_length=8 if agg == "seq_mean_token_sum_norm" else None
    )
    # ratio 1 so pg = -A; seq0 A=2 (1 token); seq1 A=1 (3 tokens); seq2 all masked; seq3 empty
    mask = [True, True, True, True, False, False]
    adv = [2, 1, 1, 1, 7, 7]
    loss, _, _ = run(cfg, [0.0] * 6, adv, cu=[0, 1, 4, 6, 6], mask=mask)
    assert loss == pytest.approx(expect, abs=1e-6)
    loss, _, _ = run(cfg, [0.0] * 6, adv, cu=[0, 1, 4, 6, 6], mask=mask, denominator=10.0)
    scale = 4 if agg == "token_mean" else 2
    assert loss == pytest.approx(expect * scale / 10, abs=1e-6)


def test_entropy_bonus():
    cfg = GRPOLossConfig(entropy_coef=0.1)
    ent = torch.tensor([1.0, 2.0], requires_grad=True)
    loss, m = grpo_loss(
        cfg,
        logprobs=torch.zeros(2),
        old_logprobs=torch.zeros(2),
        advantages=torch.zeros(2),
        loss_mask=torch.ones(2, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, 2]),
        entropy=ent,
    )
    loss.backward()
    assert loss.item() == pytest.approx(-0.15)
    assert ent.grad.tolist() == pytest.approx([-0.05, -0.05])
    assert reduce_metrics([m])["entropy/mean"] == pytest.approx(1.5)


def test_on_policy_identity_is_exact():
    torch.manual_seed(0)
    n = 50
    lp = torch.randn(n) - 2
    for level in (None, "token", "sequence", "sequence_mean"):
        cfg = GRPOLossConfig(is_correction_level=level, kl_coef=0.1, ratio_level="sequence")
        adv = torch.randn(n)
        loss, m, _ = run(
            cfg,
            [0.0] * n,
            adv.tolist(),
            old=lp.tolist(),
            cu=[0, 20, 50],
            ref_logprobs=lp,
            rollout_logprobs=lp,
        )
        assert m["loss/ratio_min"] == m["loss/ratio_max"] == 1.0
        assert m["loss/kl_mean"] == 0.0
        assert m["mismatch/k1"] == 0.0 and m["mismatch/k3"] == 0.0
        if level is not None:
            assert m["is/weight_min"] == m["is/weight_max"] == 1.0
        assert loss == pytest.approx(-adv.double().mean().item(), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_use_float32_math(dtype):
    torch.manual_seed(1)
    n = 64
    cfg = GRPOLossConfig(kl_coef=0.1, is_correction_level="token", entropy_coef=0.01)
    inputs = {k: torch.randn(n).to(dtype) for k in ("old", "adv", "ref", "roll", "ent")}
    lp = (inputs["old"].float() + 0.1 * torch.randn(n)).to(dtype)

    def call(cast):
        x = {k: cast(v) for k, v in inputs.items()}
        return grpo_loss(
            cfg,
            logprobs=cast(lp),
            old_logprobs=x["old"],
            advantages=x["adv"],
            loss_mask=torch.ones(n, dtype=torch.bool),
            cu_seqlens=torch.tensor([0, n]),
            ref_logprobs=x["ref"],
            rollout_logprobs=x["roll"],
            entropy=x["ent"],
        )[0]

    low = call(lambda v: v)
    assert low.dtype == torch.float32
    # identical to the float32 loss of the same (rounded) values, not a low-precision result
    assert low.item() == pytest.approx(call(lambda v: v.float()).item(), abs=1e-6)
