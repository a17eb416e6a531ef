"""fused_grpo_loss == grpo_loss(vocab_parallel_logprobs(...)): loss, metrics, log-probs, entropy
and gradients, at TP=1 (in process) and TP=2 with and without sequence parallelism (spawned)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_grpo.loss import GRPOLossConfig, grpo_loss
from megatron_grpo.ops import fused_grpo_loss, vocab_parallel_logprobs
from megatron_grpo.ops import tiling as tiling_mod
from megatron_grpo.ops.lm_head import LMHead
from tests.dist_utils import run_distributed
from tests.test_logprobs import close, make_inputs

T, H, V, VOCAB = 30, 16, 40, 37  # V = padded rows of the full weight
CU = torch.tensor([0, 10, 18, 30])
PROMPT = (4, 3, 5)  # leading prompt tokens of each sequence

CONFIGS = {
    "token_full": dict(kl_coef=0.05, entropy_coef=0.01, dual_clip_c=3.0,
                       is_correction_level="token", is_truncate=2.0),
    "token_plain": dict(loss_agg="seq_mean_token_sum_norm", max_response_length=12),
    "gspo": dict(ratio_level="sequence", loss_agg="seq_mean_token_mean", kl_coef=0.05,
                 entropy_coef=0.02, clip_eps_low=3e-4, clip_eps_high=4e-4),
}  # fmt: skip


def loss_batch(hidden, weight_full, temperature):
    """Targets, mask and policy-independent loss inputs around the current policy."""
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(T, dtype=torch.bool)
    for start, n in zip(CU[:-1].tolist(), PROMPT, strict=True):
        mask[start : start + n] = False
    targets = torch.randint(0, VOCAB, (T,), generator=g)
    targets = torch.where(mask, targets, torch.full_like(targets, -100))
    with torch.no_grad():
        logp = vocab_parallel_logprobs(
            hidden.float(), weight_full[:VOCAB].float(), targets, temperature=temperature,
            rows=mask, impl="torch",
        )  # fmt: skip
    noise = torch.randn(3, T, generator=g) * 0.3
    seq_adv = torch.randn(len(PROMPT), generator=g)
    batch = dict(
        old_logprobs=logp + noise[0], ref_logprobs=logp + noise[1],
        rollout_logprobs=logp + noise[0] + 0.1 * noise[2],
        advantages=seq_adv.repeat_interleave(CU.diff()), loss_mask=mask, cu_seqlens=CU,
    )  # fmt: skip
    return targets, batch


def metric_values(metrics) -> dict[str, float]:
    out = {}
    for k, m in metrics.items():
        if hasattr(m, "count"):
            out[k] = float(m.sum) / float(m.count)
        else:
            out[k] = float(m.sum if hasattr(m, "sum") else m.value)
    return out


def run_both(cfg, h, w, targets, batch, *, scale=1.0, **op):
    """(loss, metrics, logp, ent, d_hidden, d_weight) of the fused path and of the reference."""
    results = []
    for fused in (True, False):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        if fused:
            loss, met, lp, ent = fused_grpo_loss(hh, ww, targets, cfg, return_entropy=True,
                                                 **batch, **op)  # fmt: skip
        else:
            lp, ent = vocab_parallel_logprobs(hh, ww, targets, rows=batch["loss_mask"],
                                              return_entropy=True, **op)  # fmt: skip
            loss, met = grpo_loss(cfg, logprobs=lp, entropy=ent, **batch)
        (loss * scale).backward()
        results.append((loss.detach(), metric_values(met), lp.detach(), ent.detach(), hh.grad,
                        ww.grad))  # fmt: skip
    return results


def assert_same(fused, ref, grads=True):
    close(fused[0], ref[0], rtol=1e-5, atol=1e-7)
    assert fused[1].keys() == ref[1].keys()
    for k in ref[1]:
        a, b = fused[1][k], ref[1][k]
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(
            a, b, rel_tol=1e-5, abs_tol=1e-6
        ), k
    close(fused[2], ref[2])
    close(fused[3], ref[3], atol=1e-5)
    if grads:
        close(fused[4], ref[4], rtol=1e-4, atol=1e-6)
        close(fused[5], ref[5], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_grpo_loss_tp1(name, dtype):
    cfg = GRPOLossConfig(**CONFIGS[name])
    hidden, weight, _ = make_inputs(T, H, V, dtype=dtype)
    weight[VOCAB:] = 50.0
    targets, batch = loss_batch(hidden, weight, 0.8)
    op = dict(temperature=0.8, vocab_size=VOCAB, chunk_size=7, impl="torch")
    fused, ref = run_both(cfg, hidden, weight, targets, batch, scale=2.5, **op)
    if dtype == torch.float32:
        assert_same(fused, ref)
        assert fused[1]["loss/pg_clipfrac_high"] + fused[1]["loss/pg_clipfrac_low"] > 0
    else:  # bf16 gradients: both round d logits to bf16, in different chunkings
        assert_same(fused, ref, grads=False)
        for i in (4, 5):
            close(fused[i], ref[i], rtol=2e-2, atol=1e-2 * ref[i].abs().max().item())
    assert (fused[2][~batch["loss_mask"]] == 0).all() and (fused[4][~batch["loss_mask"]] == 0).all()


def test_fused_token_pass_is_one_pass_over_loss_rows(monkeypatch):
    """Token ratio: logits only for loss rows, in row blocks: one statistics pass in forward,
    one recompute pass in backward (the op's passes; the loss is evaluated once in between)."""
    seen: list[tuple[int, int]] = []
    original = LMHead.logits

    def spy(self, h, start, stop, buf):
        seen.append((h.shape[0], stop - start))
        return original(self, h, start, stop, buf)

    monkeypatch.setattr(LMHead, "logits", spy)
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 1.0)
    seen.clear()
    h = hidden.clone().requires_grad_()
    loss, _, _ = fused_grpo_loss(h, weight, targets, GRPOLossConfig(), chunk_size=8,
                                 vocab_size=VOCAB, impl="torch", **batch)  # fmt: skip
    n = int(batch["loss_mask"].sum())
    one_pass = [(8, VOCAB)] * (n // 8) + [(n % 8, VOCAB)]
    assert seen == one_pass
    loss.backward()
    assert seen == one_pass * 2


@pytest.mark.parametrize("main_grad", [False, True])
def test_fused_2d_tiles(monkeypatch, main_grad):
    """Vocab tiles that do not divide the vocabulary: the fused path equals the unfused one
    (bf16, both d_weight destinations: vocab-outer into a bf16 grad, rows-outer into main_grad)."""
    monkeypatch.setattr(tiling_mod, "TILE_BYTES", 4 * 5 * 11)  # chunk 5 -> 11-column tiles
    cfg = GRPOLossConfig(**CONFIGS["token_full"])
    hidden, weight, _ = make_inputs(T, H, V, dtype=torch.bfloat16)
    targets, batch = loss_batch(hidden, weight, 0.8)
    op = dict(temperature=0.8, vocab_size=VOCAB, chunk_size=5, impl="torch")
    out = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if main_grad:
            w.main_grad = torch.zeros(w.shape)
        if fused:
            loss, _, lp = fused_grpo_loss(h, w, targets, cfg, **batch, **op)
        else:
            lp, ent = vocab_parallel_logprobs(h, w, targets, rows=batch["loss_mask"],
                                              return_entropy=True, **op)  # fmt: skip
            loss, _ = grpo_loss(cfg, logprobs=lp, entropy=ent, **batch)
        (2.0 * loss).backward()
        out.append((loss.detach(), lp.detach(), h.grad, w.main_grad if main_grad else w.grad))
    for a, b in zip(*out, strict=True):  # the same passes: equal up to fp32 reassociation
        close(a.float(), b.float(), rtol=1e-5, atol=1e-5 * b.float().abs().max().item())
    assert out[0][3].dtype == (torch.float32 if main_grad else torch.bfloat16)


def test_fused_main_grad_scaled_by_grad_output():
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 1.0)
    cfg = GRPOLossConfig(**CONFIGS["token_full"])
    op = dict(vocab_size=VOCAB, chunk_size=5, impl="torch")
    expected = run_both(cfg, hidden, weight, targets, batch, scale=3.0, **op)[1][5]
    w = weight.clone().requires_grad_()
    w.main_grad = torch.ones(w.shape)
    loss, _, _ = fused_grpo_loss(hidden, w, targets, cfg, **batch, **op)
    (3.0 * loss).backward()
    assert w.grad is None
    close(w.main_grad - 1.0, expected, rtol=1e-4, atol=1e-6)


def test_fused_rejects_bad_inputs():
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 1.0)
    with pytest.raises(TypeError, match="cfg"):
        fused_grpo_loss(hidden, weight, targets, {"kl_coef": 0.1}, **batch)
    bad = targets.clone()
    bad[CU[1] + PROMPT[1]] = VOCAB  # first response token of sequence 1
    with pytest.raises(ValueError, match=rf"targets\[{int(CU[1]) + PROMPT[1]}\]"):
        fused_grpo_loss(hidden, weight, bad, GRPOLossConfig(), vocab_size=VOCAB, **batch)


# ---------------------------------------------------------------- TP = 2 (spawned)


def _tp2_body(rank: int, world_size: int) -> None:
    group = dist.new_group(list(range(world_size)))
    hidden, weight, _ = make_inputs(T, H, V)
    weight[VOCAB:] = 50.0
    targets, batch = loss_batch(hidden, weight, 0.9)
    v_local, t_local = V // world_size, T // world_size
    w_loc = weight[rank * v_local : (rank + 1) * v_local]
    for name in ("token_full", "gspo"):
        cfg = GRPOLossConfig(**CONFIGS[name])
        single = run_both(cfg, hidden, weight, targets, batch, temperature=0.9, vocab_size=VOCAB,
                          impl="torch")[1]  # fmt: skip
        for sp in (False, True):
            h_loc = hidden[rank * t_local : (rank + 1) * t_local] if sp else hidden
            op = dict(tp_group=group, sequence_parallel=sp, temperature=0.9, vocab_size=VOCAB,
                      chunk_size=6, impl="torch")  # fmt: skip
            fused, ref = run_both(cfg, h_loc, w_loc, targets, batch, **op)
            assert_same(fused, ref)
            # ... and both equal the TP=1 result (on this rank's slices).
            assert_same(fused, single, grads=False)
            dh_single = single[4][rank * t_local : (rank + 1) * t_local] if sp else single[4]
            close(fused[4], dh_single, rtol=1e-4, atol=1e-6)
            close(fused[5], single[5][rank * v_local : (rank + 1) * v_local], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_fused_matches_grpo_loss_tp2():
    run_distributed(_tp2_body, 2)
