"""Vocab-parallel sampling (rollout/engine/tp_sampling.py) draws what the gathered path draws.

Each TP rank samples from its vocabulary shard with two small collectives; the reference is
``sampling.sample`` on the whole fp32 logits. Greedy tokens are equal; sampled tokens are equal
unless the target lies within rounding of a CDF boundary (then the drawn token is one of the two
at that boundary), and every recorded log-prob is the whole vocabulary's log-softmax.
"""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.rollout.engine.params import SamplingParams
from megatron_grpo.rollout.engine.sampling import sample
from megatron_grpo.rollout.engine.tp_sampling import sample_vocab_parallel, sampling_path
from tests.dist_utils import run_distributed

VOCAB, PADDED, ROWS = 1000, 1024, 37


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, PADDED, generator=g) * 3
    x[:, VOCAB:] = 50.0  # padding rows of the output weight: never drawn, never counted
    x[0] = 0.0  # all tokens tied
    x[1, 7] = x[1, 900] = 40.0  # greedy ties in different shards
    x[2] = -1e4  # hostile scale
    x[2, 999] = 1e4
    x[3, :500] = -float("inf")  # a shard without mass (at TP 2)
    return x


def _check(rank: int, world: int, params: SamplingParams, seed: int) -> None:
    import torch.distributed as dist

    logits = _logits(seed)
    u = torch.rand(ROWS, generator=torch.Generator().manual_seed(seed + 1))
    u[5] = 0.0
    u[6] = 1.0 - 2**-24
    width = PADDED // world
    local = logits[:, rank * width : (rank + 1) * width]
    group = dist.group.WORLD if world > 1 else None
    tokens, logp = sample_vocab_parallel(local, rank * width, u, params, group)
    want_tokens, _ = sample(logits, u, params)
    scaled = logits[:, :VOCAB].double() / params.temperature
    truth = torch.log_softmax(scaled, -1)
    what = f"TP {world} top_k={params.top_k} T={params.temperature}"
    assert (tokens < VOCAB).all() and (tokens >= 0).all(), what
    assert torch.allclose(logp.double(), truth.gather(1, tokens[:, None])[:, 0], atol=1e-5), what
    if params.top_k == 1:
        assert torch.equal(tokens, want_tokens), what
        return
    cdf = truth.exp().cumsum(-1)
    target = u.double()
    differ = (tokens != want_tokens).nonzero()[:, 0].tolist()
    for i in differ:  # only at a boundary, within rounding
        lo, hi = sorted((tokens[i].item(), want_tokens[i].item()))
        assert hi == lo + 1 and abs(cdf[i, lo] - target[i]) < 1e-5, f"{what}: row {i}"
    assert len(differ) <= 1, what
    gathered = [None] * world if world > 1 else None
    if world > 1:  # every rank holds the same tokens
        dist.all_gather_object(gathered, (tokens.tolist(), logp.tolist()))
        assert all(g == gathered[0] for g in gathered), what


def _body(rank: int, world: int) -> None:
    for seed in range(3):
        for params in (
            SamplingParams(vocab_size=VOCAB, max_new_tokens=4),
            SamplingParams(vocab_size=VOCAB, max_new_tokens=4, temperature=0.7),
            SamplingParams(vocab_size=VOCAB, max_new_tokens=4, top_k=1),
        ):
            _check(rank, world, params, seed)


def test_vocab_parallel_sampling_one_shard():
    _body(0, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_sampling_equals_gathered(world):
    run_distributed(_body, world)


def test_sampling_path_is_one_decision():
    plain = SamplingParams(vocab_size=VOCAB, max_new_tokens=4)
    greedy = SamplingParams(vocab_size=VOCAB, max_new_tokens=4, top_k=1)
    nucleus = SamplingParams(vocab_size=VOCAB, max_new_tokens=4, top_p=0.9)
    assert sampling_path("auto", plain, 2) == "vocab_parallel"
    assert sampling_path("auto", greedy, 4) == "vocab_parallel"
    assert sampling_path("auto", nucleus, 2) == "gathered"
    assert sampling_path("auto", plain, 1) == "gathered"
    assert sampling_path("gathered", plain, 2) == "gathered"
    with pytest.raises(ValueError, match="tp_sampling 'vocab_parallel'.*top_p=0.9"):
        sampling_path("vocab_parallel", nucleus, 2)
    with pytest.raises(ValueError, match="tp_sampling must be one of"):
        sampling_path("shard", plain, 2)


def _generate(model, prompts, options, **kw):
    from megatron_grpo.rollout import KVCacheEngine, generate
    from tests.megatron_utils import VOCAB as V

    params = SamplingParams(max_new_tokens=8, eos_id=3, vocab_size=V, **kw)
    engine = KVCacheEngine(model, options)
    return generate(model, prompts, params, torch.Generator().manual_seed(9), engine=engine)


def _engine_body(rank: int, world: int) -> None:
    """The TP 2 engine with vocab-parallel sampling against the TP 1 engine (same weights)."""
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions
    from megatron_grpo.rollout.engine import tp_sampling
    from tests.megatron_utils import build_layout, full_params, load_full, tiny_model

    cfg = tiny_model(init_method_std=0.3)
    ref = build_layout(ParallelConfig(), cfg)  # TP 1 (DP 2)
    weights = full_params(ref)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (2, 5, 9, 4, 7)]
    opts = EngineOptions(kv_cache_gib=0.01, context_bucket=16)
    want = _generate(unwrap(ref[0]), prompts, opts, top_k=1)
    chunks = build_layout(ParallelConfig(tensor_model_parallel_size=world), cfg)
    load_full(chunks, weights, cfg)
    calls = []
    real = tp_sampling.sample_vocab_parallel
    tp_sampling.sample_vocab_parallel = lambda *a: calls.append(1) or real(*a)
    try:
        vp = EngineOptions(kv_cache_gib=0.01, context_bucket=16, tp_sampling="vocab_parallel")
        got = _generate(unwrap(chunks[0]), prompts, vp, top_k=1)
    finally:
        tp_sampling.sample_vocab_parallel = real
    assert calls, "the engine did not sample vocab-parallel"
    assert got.responses == want.responses
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5)


def test_tp2_engine_vocab_parallel_greedy_equals_tp1():
    """Greedy tokens of the TP 2 engine sampling from vocabulary shards equal the TP 1
    engine's (same converted weights); their log-probs agree within 1e-5."""
    run_distributed(_engine_body, 2, timeout=300)
