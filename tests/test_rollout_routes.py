"""Routes recorded by our generation (Rollout Routing Replay, R3) at EP=2 and TP=2 (SP on): both
engines record the routes a teacher-forced forward over prompt + response takes (last row -1);
the trainer's packing of the generated rollouts replays them, so after the router weights were
perturbed the no-grad and training forwards still give the generation's recorded log-probs
(without replay they differ), and the router still gets gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import parallel_state

from megatron_grpo.loss import GRPOLossConfig, reduce_metrics
from megatron_grpo.megatron import GRPOStep, ParallelConfig, unwrap
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.moe.routing_replay import (
    check_routes,
    record_routes,
    replay_mismatch,
    replay_routes,
)
from megatron_grpo.rollout import EngineOptions, KVCacheEngine, SamplingParams, generate
from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.engine.kv_cache import CacheShape
from megatron_grpo.train.batching import make_mini_batches
from tests.dist_utils import run_distributed
from tests.megatron_utils import VOCAB, build_layout, tiny_model, train_grads
from tests.test_routing_replay import _router_grad, _twin_routers

LAYERS, TOPK, EXPERTS = 2, 2, 4


def _moe():
    return tiny_model(
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=32,
        moe_enable_routing_replay=True, init_method_std=0.3,
    )  # fmt: skip


def _perturb_routers(chunks) -> None:
    """Break the twin experts' tie (see ``_twin_routers``) by 1e-7 of the router's scale: the
    selection of many tokens flips, the gating weights move by ~1e-7 (this peaked model turns
    1e-5 into log-prob changes above 1e-5)."""
    g = torch.Generator().manual_seed(3)  # same draw on every rank: routers are replicated
    with torch.no_grad():
        for name, p in unwrap(chunks[0]).named_parameters():
            if name.endswith("router.weight"):
                p[3] += torch.randn(p.shape[1], generator=g) * p.abs().mean() * 1e-7


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in
            torch.randint(1, 10, (n,), generator=g)]  # fmt: skip


def _generate(model, prompts) -> RolloutBatch:
    """KV-cached generation (a 3-slot cache: streaming and compaction) with routes; the recompute
    engine samples the same tokens and records the same routes."""
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10, eos_id=3,
                            vocab_size=VOCAB)  # fmt: skip
    per_seq = CacheShape.of(model).bytes_per_token * 24  # prompts < 10 tokens + 10 new
    engine = KVCacheEngine(model, EngineOptions(kv_cache_gib=3 * per_seq / 2**30, context_bucket=8))
    got = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine,
                   record_routes=True)  # fmt: skip
    want = generate(model, prompts, params, torch.Generator().manual_seed(5), engine="recompute",
                    record_routes=True)  # fmt: skip
    assert engine.stats["slots"] < len(prompts)
    assert got.responses == want.responses, (got.responses, want.responses)
    for p, r, a, b in zip(prompts, got.responses, got.routes, want.routes, strict=True):
        assert a.dtype == torch.int64 and a.shape == (len(p) + len(r), LAYERS, TOPK), a.shape
        assert torch.equal(a, b), "the engines recorded different routes"
        assert bool((a[-1] == -1).all()), "the last response token is never fed"
    batch = RolloutBatch(prompts, got.responses, list(range(len(prompts))), got.logprobs,
                         [0.0] * len(prompts), routed_experts=got.routes)  # fmt: skip
    check_routes(got.routes, batch.origin, num_moe_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
    return batch


def _pack(batch: RolloutBatch, layout: ParallelLayout) -> list:
    """The trainer's packing (micro-batches of 2 samples; under EP equal counts and tokens)."""
    ep = parallel_state.get_expert_model_parallel_world_size() > 1
    count = parallel_state.get_data_parallel_group() if ep else None
    tokens = parallel_state.get_expert_tensor_and_model_parallel_group() if ep else None
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    [mbs] = make_mini_batches(batch, adv, 1, 2, None, layout, count_group=count,
                              token_group=tokens, with_routes=True)  # fmt: skip
    return mbs


def _check_teacher_forced_routes(step, chunks, mbs) -> None:
    """A teacher-forced forward routes every fed token as the generation did."""
    with record_routes(chunks) as rec:
        step.compute_logprobs(chunks, [dataclasses.replace(mb, routes=None) for mb in mbs])
        forced = rec.take().split([mb.num_tokens for mb in mbs])
    for mb, f in zip(mbs, forced, strict=True):
        fed = mb.routes[:, 0, 0] >= 0
        cu = mb.cu_seqlens.tolist()
        for start, end in zip(cu[:-1], cu[1:], strict=True):  # samples: all but the last token
            real = bool(mb.loss_mask[start:end].any())
            assert fed[start:end].tolist() == [real] * (end - start - 1) + [False]
        assert torch.equal(f[fed], mb.routes[fed]), "generation and forward routed differently"


def _body(rank: int, world: int, parallel: ParallelConfig) -> None:
    chunks = build_layout(parallel, _moe())
    _twin_routers(chunks)
    # DP ranks (EP) generate different prompts and lengths: dummy rows keep them in step.
    dp = parallel_state.get_data_parallel_rank()
    prompts = _prompts(5 + 2 * dp, seed=20 + dp)
    batch = _generate(unwrap(chunks[0]), prompts)
    mbs = _pack(batch, ParallelLayout.of_config(parallel))
    step = GRPOStep(GRPOLossConfig(), vocab_size=VOCAB)
    _check_teacher_forced_routes(step, chunks, mbs)
    _perturb_routers(chunks)
    live = [dataclasses.replace(mb, routes=None) for mb in mbs]
    gaps = [(lp - mb.rollout_logprobs)[mb.loss_mask].abs().max()
            for mb, lp in zip(mbs, step.compute_logprobs(chunks, live), strict=True)]  # fmt: skip
    assert max(gaps) > 1e-3, "perturbing the routers changed nothing"
    for mb, lp in zip(mbs, step.compute_logprobs(chunks, mbs), strict=True):
        m = mb.loss_mask
        torch.testing.assert_close(lp[m], mb.rollout_logprobs[m], rtol=0, atol=1e-5)
        mb.old_logprobs = mb.rollout_logprobs  # old = the generation's: ratio 1 under replay
    mismatched, replayed = replay_mismatch(chunks).tolist()
    assert 0 < mismatched < replayed, (mismatched, replayed)
    with replay_routes(chunks):
        m = reduce_metrics(train_grads(chunks, step, mbs))
    assert abs(m["loss/ratio_min"] - 1) < 1e-5 and abs(m["loss/ratio_max"] - 1) < 1e-5, m
    assert _router_grad(chunks) > 1e-6, "no gradient reached the router"
    for mb in live:
        mb.old_logprobs = mb.rollout_logprobs
    m = reduce_metrics(train_grads(chunks, step, live))
    assert max(abs(m["loss/ratio_min"] - 1), abs(m["loss/ratio_max"] - 1)) > 1e-3, m


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(expert_model_parallel_size=2),
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    ],
    ids=["ep2", "tp2_sp"],
)
def test_generated_routes_replay_the_recorded_logprobs(parallel):
    run_distributed(_body, 2, parallel)


def _dense_body(rank: int, world: int) -> None:
    chunks = build_layout(ParallelConfig(), tiny_model())
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2, eos_id=3,
                            vocab_size=VOCAB)  # fmt: skip
    for engine in ("kv_cache", "recompute"):
        with pytest.raises(ValueError, match="record_routes needs an MoE model"):
            generate(unwrap(chunks[0]), [[1, 2]], params, torch.Generator(), engine=engine,
                     record_routes=True)  # fmt: skip


@pytest.mark.slow
def test_record_routes_needs_moe():
    run_distributed(_dense_body, 1)
