"""MoE model (megatron-core MoELayer, all-to-all dispatcher) at EP=2 vs EP=1, and its aux loss."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep, ParallelConfig, unwrap
from tests.dist_utils import run_distributed
from tests.megatron_utils import (
    assert_close,
    build_layout,
    full_params,
    gather_full_grads,
    load_full,
    make_sequences,
    pack,
    tiny_model,
    train_grads,
)

pytestmark = pytest.mark.slow


def _moe(coeff: float):
    return tiny_model(
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=coeff
    )


def _router_grad(chunks) -> torch.Tensor:
    return torch.cat(
        [p.main_grad.flatten() for n, p in unwrap(chunks[0]).named_parameters() if "router" in n]
    )


def _body(rank: int, world: int) -> None:
    seqs = make_sequences(4, seed=5)
    batches = [pack(seqs[:2]), pack(seqs[2:])]
    cfg = _moe(0.0)
    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    chunks = build_layout(ParallelConfig(), cfg)  # EP = 1
    weights = full_params(chunks)
    ref_logp = step.compute_logprobs(chunks, batches)
    train_grads(chunks, step, batches)
    ref_grads = gather_full_grads(chunks, cfg)
    ep2 = ParallelConfig(expert_model_parallel_size=2)
    chunks = build_layout(ep2, cfg)
    load_full(chunks, weights, cfg)
    for got, want in zip(step.compute_logprobs(chunks, batches), ref_logp, strict=True):
        assert_close("EP2 logprobs", got, want)
    train_grads(chunks, step, batches)
    for name, g in gather_full_grads(chunks, cfg).items():
        assert_close(f"EP2 grad {name}", g, ref_grads[name], tol=5e-5)
    # Aux loss: with zero advantages the policy loss has no gradient, so router gradients come
    # from the load-balancing loss alone: zero without it, non-zero with it.
    flat = [{**s, "adv": 0.0} for s in seqs]
    zero_adv = [pack(flat[:2]), pack(flat[2:])]
    for coeff in (0.0, 0.1):
        chunks = build_layout(ep2, _moe(coeff))
        load_full(chunks, weights, cfg)
        train_grads(chunks, step, zero_adv)
        norm = _router_grad(chunks).abs().sum().item()
        assert (norm > 1e-6) == (coeff > 0), f"router grad {norm} with aux coeff {coeff}"


def test_moe_ep2_matches_ep1_and_counts_aux_loss():
    run_distributed(_body, 2)
