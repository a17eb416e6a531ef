"""``loss.kl_gradient`` (pathwise | unbiased) against the closed forms of k1 / k2 / k3 with and
without clamps, through ``grpo_loss`` and ``fused_grpo_loss`` (torch; Triton in the interpreter),
and ``loss.is_mask_scope`` (what an MIS drop removes)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_grpo.config import ConfigError
from megatron_grpo.loss import GRPOLossConfig, grpo_loss, reduce_metrics
from megatron_grpo.ops import fused_grpo_loss, vocab_parallel_logprobs
from megatron_grpo.train.config import load_train_config
from tests.test_fused_grpo import (
    FUSED,
    PATHS,
    VOCAB,
    H,
    T,
    V,
    assert_same,
    loss_batch,
    ran_path,
    run_both,
)
from tests.test_logprobs import close, make_inputs
from tests.test_loss_values import LN, run

ROOT = Path(__file__).resolve().parents[1]
K = {"k1": lambda x: -x, "k2": lambda x: x * x / 2, "k3": lambda x: math.exp(x) - 1 - x}
DK = {"k1": lambda x: 1.0, "k2": lambda x: -x, "k3": lambda x: 1 - math.exp(x)}  # d k / d logp
# The unbiased per-token gradient without clamps, in the documented form (logp - ref = -x).
UNBIASED = {"k1": lambda x: 1 - x, "k2": lambda x: -x + x * x / 2, "k3": lambda x: -x}


def closed_form(estimator: str, convention: str, x: float, in_c, out_c) -> tuple[float, float]:
    """(kl value, d kl_term / d logp) of one token, clamps included (module doc of loss.math)."""
    xc = x if in_c is None else max(-in_c, min(in_c, x))
    k = K[estimator](xc)
    kc = k if out_c is None else max(-out_c, min(out_c, k))
    clamped = xc != x or kc != k
    path = 0.0 if clamped else DK[estimator](xc)
    return kc, path + (kc if convention == "unbiased" else 0.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_closed_forms_without_clamps(estimator):
    xs = [0.5, -1.0, 1.5, -0.2]  # x = ref - logp; logp = 0.1 * i, A = 0: only the KL term
    lr = [0.1 * i for i in range(4)]
    ref = [x + r for x, r in zip(xs, lr, strict=True)]
    out = {}
    for conv in ("pathwise", "unbiased"):
        cfg = GRPOLossConfig(kl_coef=0.5, kl_estimator=estimator, kl_gradient=conv,
                             kl_input_clamp=None, kl_output_clamp=None)  # fmt: skip
        out[conv] = run(cfg, lr, [0] * 4, ref_logprobs=ref)
        expect = [0.5 * closed_form(estimator, conv, x, None, None)[1] / 4 for x in xs]
        assert out[conv][2].tolist() == pytest.approx(expect, abs=1e-6)
    assert out["unbiased"][2].tolist() == pytest.approx(
        [0.5 * UNBIASED[estimator](x) / 4 for x in xs], abs=1e-6
    )
    assert out["pathwise"][0] == out["unbiased"][0]  # identical values, metrics
    assert out["pathwise"][1] == out["unbiased"][1]
    assert out["pathwise"][0] == pytest.approx(0.5 * sum(K[estimator](x) for x in xs) / 4)


# (estimator, x, input clamp, output clamp): each clamp active alone, both, and neither
CLAMPED = [
    ("k1", -3.0, 2.0, None), ("k1", -1.0, None, 0.5), ("k1", 1.0, None, 0.5),
    ("k1", 0.3, 2.0, 0.5), ("k2", 3.0, 2.0, None), ("k2", -2.0, None, 1.0),
    ("k2", 0.4, 2.0, 1.0), ("k3", -3.0, 2.0, None), ("k3", 1.0, None, 0.5),
    ("k3", 4.0, 2.0, 3.0), ("k3", 0.5, 2.0, 10.0),
]  # fmt: skip


@pytest.mark.parametrize(("estimator", "x", "in_c", "out_c"), CLAMPED)
@pytest.mark.parametrize("conv", ["pathwise", "unbiased"])
def test_closed_forms_with_clamps(estimator, x, in_c, out_c, conv):
    cfg = GRPOLossConfig(kl_coef=0.5, kl_estimator=estimator, kl_gradient=conv,
                         kl_input_clamp=in_c, kl_output_clamp=out_c)  # fmt: skip
    loss, m, g = run(cfg, [0.0], [0], ref_logprobs=[x])
    value, grad = closed_form(estimator, conv, x, in_c, out_c)
    assert m["loss/kl_mean"] == pytest.approx(value, rel=1e-6)
    assert loss == pytest.approx(0.5 * value, rel=1e-6)
    assert g.item() == pytest.approx(0.5 * grad, rel=1e-6, abs=1e-7)


def _full_inputs(n: int = 7) -> dict:
    g = torch.Generator().manual_seed(3)
    old = torch.randn(n, generator=g) * 0.5 - 2.0
    return dict(
        logprobs=old + torch.randn(n, generator=g) * 0.3,
        old_logprobs=old,
        ref_logprobs=old + torch.randn(n, generator=g),
        rollout_logprobs=old + torch.randn(n, generator=g) * 0.2,
        advantages=torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5, 2.0, 2.0]),
        entropy=torch.rand(n, generator=g),
        loss_mask=torch.tensor([True, True, False, True, True, True, True]),
        cu_seqlens=torch.tensor([0, 2, 5, 7]),
    )


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_unbiased_adds_exactly_the_score_term(ratio_level):
    """Every option on: value and metrics bit-identical; the gradients differ by
    ``kl_coef * coef_t * kl_t`` (seq_mean_token_mean: coef = 1 / (S |y_i|))."""
    opts = dict(ratio_level=ratio_level, kl_coef=0.3, kl_input_clamp=0.5, kl_output_clamp=0.1,
                entropy_coef=0.01, dual_clip_c=3.0, loss_agg="seq_mean_token_mean",
                is_correction_level="token", is_truncate=1.5)  # fmt: skip
    res = {}
    for conv in ("pathwise", "unbiased"):
        inp = _full_inputs()
        lp = inp.pop("logprobs").requires_grad_()
        loss, metrics = grpo_loss(GRPOLossConfig(**opts, kl_gradient=conv), logprobs=lp, **inp)
        loss.backward()
        res[conv] = (loss.detach(), reduce_metrics([metrics]), lp.grad)
    assert torch.equal(res["pathwise"][0], res["unbiased"][0])
    assert res["pathwise"][1] == res["unbiased"][1]
    inp = _full_inputs()
    x = inp["ref_logprobs"] - inp["logprobs"]
    assert (x.abs() > 0.5).any()  # the input clamp is active somewhere
    x = x.clamp(-0.5, 0.5)
    kl = (torch.expm1(x) - x).clamp(-0.1, 0.1)
    coef = torch.tensor([1 / 2, 1 / 2, 0.0, 1 / 2, 1 / 2, 1 / 2, 1 / 2]) / 3
    close(res["unbiased"][2] - res["pathwise"][2], 0.3 * coef * kl, rtol=1e-5, atol=1e-7)
    assert (kl.abs() == 0.1).any() and (kl.abs() < 0.1).any()  # clamped and free rows


def _fused_kl_expected(cfg, h, w, targets, batch, temperature):
    """d hidden, d weight of the closed-form per-token gradient (advantages 0: KL term only)."""
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    mask = batch["loss_mask"]
    lp = vocab_parallel_logprobs(hh, ww, targets, rows=mask, temperature=temperature,
                                 vocab_size=VOCAB, impl="torch")  # fmt: skip
    xs = (batch["ref_logprobs"] - lp.detach())[mask].tolist()
    args = (cfg.kl_estimator, cfg.kl_gradient)
    clamps = (cfg.kl_input_clamp, cfg.kl_output_clamp)
    g = torch.zeros(T)
    g[mask] = torch.tensor([closed_form(*args, x, *clamps)[1] for x in xs])
    (lp * g * cfg.kl_coef / mask.sum()).sum().backward()
    return hh.grad, ww.grad


def fused_closed_form_case(estimator: str, conv: str, path: str | None, impl: str) -> bool:
    """fused_grpo_loss's gradients equal those of the closed form; returns whether any row's
    clamp was active (the case must exercise both branches)."""
    cfg = GRPOLossConfig(kl_coef=0.5, kl_estimator=estimator, kl_gradient=conv,
                         kl_input_clamp=0.5, kl_output_clamp=0.3)  # fmt: skip
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 0.8)
    batch["advantages"] = torch.zeros(T)
    noise = torch.randn(T, generator=torch.Generator().manual_seed(11))
    batch["ref_logprobs"] = batch["ref_logprobs"] + 0.4 * noise  # some |x| beyond each clamp
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _, lp = fused_grpo_loss(hh, ww, targets, cfg, temperature=0.8, vocab_size=VOCAB,
                                  chunk_size=7, impl=impl, path=FUSED[path], **batch)  # fmt: skip
    assert ran_path(loss) == (path or "op")
    loss.backward()
    dh, dw = _fused_kl_expected(cfg, hidden, weight, targets, batch, 0.8)
    close(hh.grad, dh, rtol=1e-4, atol=1e-6)
    close(ww.grad, dw, rtol=1e-4, atol=1e-6)
    x = (batch["ref_logprobs"] - lp)[batch["loss_mask"]]
    return bool((x.abs() > 0.5).any() and (x.abs() < 0.5).any())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("conv", ["pathwise", "unbiased"])
def test_fused_matches_closed_form(path, estimator, conv):
    assert fused_closed_form_case(estimator, conv, path, "torch")


_INTERPRETER_SCRIPT = """
from tests.test_loss_kl_gradient import fused_closed_form_case
for path in ("single", "tiled"):
    for est in ("k1", "k3"):
        assert fused_closed_form_case(est, "unbiased", path, "triton")
assert fused_closed_form_case("k2", "pathwise", "tiled", "triton")
print("ok")
"""


@pytest.mark.slow
def test_fused_closed_form_triton_in_interpreter():
    """impl="triton" (CPU, TRITON_INTERPRET=1 in a fresh process)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.parametrize("path", PATHS)
def test_fused_matches_grpo_loss_with_both_options(path):
    """Unbiased KL with a PG-only MIS drop: fused == op + grpo_loss (loss, metrics, grads)."""
    cfg = GRPOLossConfig(kl_coef=0.05, entropy_coef=0.01, kl_gradient="unbiased",
                         is_correction_level="token", is_mask=(0.95, 1.05),
                         is_mask_scope="pg")  # fmt: skip
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 0.8)
    op = dict(temperature=0.8, vocab_size=VOCAB, chunk_size=7, impl="torch")
    fused, ref = run_both(cfg, hidden, weight, targets, batch, scale=2.5, path=path, **op)
    assert fused[6] == path and 0 < fused[1]["is/frac_masked"] < 1
    assert_same(fused, ref)


@pytest.mark.parametrize("scope", ["all", "pg"])
def test_is_mask_scope(scope):
    """Weights 2, 0.5, 1 with is_mask (0.6, 1.8): rows 0 and 1 are dropped; "all" drops their
    KL and entropy terms too, "pg" keeps them. The count stays 3 either way."""
    cfg = GRPOLossConfig(is_correction_level="token", is_mask=(0.6, 1.8), is_mask_scope=scope,
                         kl_coef=1.0, kl_estimator="k1", entropy_coef=0.1)  # fmt: skip
    rollout, ref, ent = [-LN(2.0), -LN(0.5), 0.0], [0.5, -0.25, 1.0], [0.3, 0.6, 0.9]
    loss, m, g = run(cfg, [0.0] * 3, [1, 1, 1], rollout_logprobs=rollout, ref_logprobs=ref,
                     entropy=ent)  # fmt: skip
    keep = [False, False, True] if scope == "all" else [True, True, True]
    # per row: pg = -A r (weight 1 at row 2), k1 = logp - ref, entropy bonus -0.1 e
    pen = [-r + -0.1 * e if k else 0.0 for r, e, k in zip(ref, ent, keep, strict=True)]
    assert loss == pytest.approx((-1.0 + sum(pen)) / 3, abs=1e-6)
    assert g.tolist() == pytest.approx([float(k) / 3 for k in keep[:2]] + [0.0], abs=1e-6)
    assert m["is/frac_masked"] == pytest.approx(2 / 3)
    assert m["loss/kl_mean"] == pytest.approx(-sum(ref) / 3, abs=1e-6)


def test_recipe_keys_reach_the_loss_config():
    recipe = ROOT / "recipes" / "tiny.yaml"
    sets = ["loss.kl_gradient=unbiased", "loss.is_correction_level=token",
            "loss.is_mask=[0.5, 2.0]", "loss.is_mask_scope=pg"]  # fmt: skip
    cfg = load_train_config(recipe, sets)
    assert (cfg.loss.kl_gradient, cfg.loss.is_mask_scope) == ("unbiased", "pg")
    assert load_train_config(recipe).loss.kl_gradient == "pathwise"
    with pytest.raises(ConfigError, match="kl_gradient"):
        load_train_config(recipe, ["loss.kl_gradient=reinforce"])
    with pytest.raises(ConfigError, match="did you mean 'kl_gradient'"):
        load_train_config(recipe, ["loss.kl_gradiant=unbiased"])
