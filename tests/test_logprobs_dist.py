"""vocab_parallel_logprobs at TP = 4, 2, 1 (one spawn of 4 gloo processes) against float64 full
logits and Megatron's vocab_parallel_cross_entropy, with and without sequence parallelism, with
2D (row x vocab) tiles and with whole-shard tiles."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_grpo.ops import vocab_parallel_logprobs
from megatron_grpo.ops.lm_head.plan import TILE_FRACTION
from tests.dist_utils import run_distributed
from tests.test_logprobs import close, make_inputs, ref_logprobs, rel_err, upstream

T, H = 24, 16

# (sequence_parallel, vocab_size, temperature, chunk_size, masked, dtype)
CASES = [
    (False, 40, 1.0, 5, False, torch.float32),
    (True, 40, 0.7, 3, True, torch.float32),
    (True, 29, 1.3, 7, True, torch.float32),  # TP4: last shard all padding; TP2: 9 of 20 valid
    (False, 37, 0.9, None, True, torch.float32),  # vocab not divisible by TP
    (True, 37, 1.0, 4, False, torch.bfloat16),
]


def _shard_inputs(case, tp: int, rank: int):
    sp, vocab, temperature, chunk, masked, dtype = case
    v_local = -(-vocab // tp)
    hidden, weight, targets = make_inputs(T, H, v_local * tp, dtype=dtype, seed=vocab + tp)
    weight[vocab:] = 50.0  # padded rows: would dominate every softmax if they counted
    targets = targets % vocab
    rows = None
    if masked:
        rows = torch.arange(T) % 4 != 1
        targets = torch.where(rows, targets, torch.full_like(targets, -100))
    t_local = T // tp if sp else T
    h_loc = hidden[rank * t_local : (rank + 1) * t_local] if sp else hidden
    w_loc = weight[rank * v_local : (rank + 1) * v_local]
    return hidden, weight, targets, rows, h_loc.clone(), w_loc.clone(), v_local


def _run_ours(case, group, h_loc, w_loc, targets, rows, g_lp, g_ent):
    sp, vocab, temperature, chunk, _, _ = case
    # With a chunk: 2D tiles of 6 vocab columns (not dividing the shards); else the default.
    budget = TILE_FRACTION * 4 * chunk * 6 if chunk else None
    h = h_loc.requires_grad_()
    w = w_loc.requires_grad_()
    lp, ent = vocab_parallel_logprobs(
        h, w, targets, tp_group=group, sequence_parallel=sp, temperature=temperature,
        vocab_size=vocab, return_entropy=True, chunk_size=chunk, impl="torch", rows=rows,
        memory_budget=budget,
    )  # fmt: skip
    (lp * g_lp + ent * g_ent).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _megatron_logp(case, group, hidden, w_loc, targets, rows, g_lp):
    """-vocab_parallel_cross_entropy on materialized fp32 logits, with its gradients."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    _, _, temperature, _, _, _ = case
    h = hidden.detach().to(torch.float32, copy=True).requires_grad_()
    w = w_loc.detach().to(torch.float32, copy=True).requires_grad_()
    logits = (h @ w.t()) / temperature
    safe = torch.where(rows, targets, 0) if rows is not None else targets
    logp = -vocab_parallel_cross_entropy(logits.clone(), safe)  # it mutates fp32 input in place
    if rows is not None:
        logp = torch.where(rows, logp, torch.zeros_like(logp))
    (logp * g_lp).sum().backward()
    dist.all_reduce(h.grad, group=group)  # each shard's partial d_hidden
    return logp.detach(), h.grad, w.grad


def _check_case(case, group, tp: int, rank: int) -> None:
    sp, vocab, temperature, _, _, dtype = case
    hidden, weight, targets, rows, h_loc, w_loc, v_local = _shard_inputs(case, tp, rank)
    g_lp, g_ent = upstream(T, seed=tp)
    lp, ent, dh, dw = _run_ours(case, group, h_loc, w_loc, targets, rows, g_lp, g_ent)

    every = [torch.empty_like(lp) for _ in range(tp)]
    dist.all_gather(every, lp, group=group)
    assert all(torch.equal(x, lp) for x in every), "logp differs across TP ranks"

    h64 = hidden.double().requires_grad_()
    w64 = weight[:vocab].double().requires_grad_()
    lp64, ent64 = ref_logprobs(h64, w64, targets, temperature=temperature, rows=rows)
    (lp64 * g_lp.double() + ent64 * g_ent.double()).sum().backward()
    t_local = h_loc.shape[0]
    dh64 = h64.grad[rank * t_local : (rank + 1) * t_local] if sp else h64.grad
    dw64 = torch.zeros(v_local, H, dtype=torch.float64)
    own = w64.grad[rank * v_local : (rank + 1) * v_local]
    dw64[: own.shape[0]] = own
    if dtype == torch.float32:
        close(lp, lp64)
        close(ent, ent64, atol=1e-5)
        close(dh, dh64, rtol=1e-4, atol=1e-5)
        close(dw, dw64, rtol=1e-4, atol=1e-5)
    else:
        assert (lp - lp64).abs().max() <= 1e-4, (lp - lp64).abs().max()
        for got, exact in ((dh, dh64), (dw[: own.shape[0]], own)):
            assert got.dtype == torch.bfloat16
            bound = 3 * rel_err(exact.to(torch.bfloat16), exact)  # output + d logits rounding
            assert rel_err(got, exact) <= bound, (rel_err(got, exact), bound)
    assert (dw[own.shape[0] :] == 0).all()  # padded rows get no gradient
    if vocab == v_local * tp and dtype == torch.float32:  # Megatron's CE knows no padding
        lp_m, dh_m, dw_m = _megatron_logp(case, group, hidden, w_loc, targets, rows, g_lp)
        close(lp, lp_m, rtol=1e-5, atol=1e-5)
        _, _, dh_lp, dw_lp = _run_ours(
            case, group, h_loc.detach().clone(), w_loc.detach().clone(), targets, rows, g_lp,
            torch.zeros_like(g_ent),
        )  # fmt: skip
        close(dh_lp, dh_m[rank * t_local : (rank + 1) * t_local] if sp else dh_m, atol=1e-5)
        close(dw_lp, dw_m, atol=1e-5)


def _body(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state as ps

    for tp in (4, 2, 1):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        group = ps.get_tensor_model_parallel_group()
        for case in CASES:
            try:
                _check_case(case, group, tp, ps.get_tensor_model_parallel_rank())
            except AssertionError as e:
                raise AssertionError(f"TP={tp} case={case}: {e}") from e
        ps.destroy_model_parallel()


@pytest.mark.slow
def test_tp_1_2_4_against_float64_and_megatron():
    run_distributed(_body, 4)
