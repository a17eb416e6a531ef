"""Requests paused and resumed across a weight update (``KVCacheEngine.run_requests``):
provenance (each token's version and behaviour log-prob against a teacher-forced recompute
under that version), ``kv: keep`` against an uninterrupted generation whose weights change in
place at the same step, per-sample limits, and the long-tailed toy task."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_rollout import _model, _params, _prompts


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """An 'optimizer step': every weight moves by a seeded amount, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * p.abs().mean() * torch.randn(p.shape, generator=g).to(p.dtype))


def _load(model: torch.nn.Module, weights: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights, strict=True):
            p.copy_(w)


def _requests(prompts, uniforms, limits=None):
    from megatron_grpo.rollout.engine.requests import Request

    limits = limits or [None] * len(prompts)
    return [Request(p, u, k) for p, u, k in zip(prompts, uniforms, limits, strict=True)]


def _teacher_forced(model, reqs, params, version: int):
    """For every token of ``version``: the token and log-prob the recompute oracle samples from
    its prefix under the current weights with its uniform number."""
    from megatron_grpo.megatron.layout import ParallelLayout
    from megatron_grpo.rollout.engine import model_io as io
    from megatron_grpo.rollout.engine.sampling import sample

    seqs, uniforms, want = [], [], []
    for r in reqs:
        for t, v in enumerate(r.versions):
            if v == version:
                seqs.append(r.prompt + r.tokens[:t])
                uniforms.append(r.uniforms[t])
                want.append((r.tokens[t], r.logprobs[t]))
    model.eval()
    with torch.no_grad():
        layout = ParallelLayout.current(model.config.sequence_parallel)
        hidden = io.packed_last_hidden(model, *io.packed_inputs(seqs, 1), layout=layout)
        tokens, logp = sample(io.head_logits(model, hidden, layout), torch.stack(uniforms), params)
    return want, list(zip(tokens.tolist(), logp.tolist(), strict=True))


def _provenance_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine

    _, chunks = _model(ParallelConfig())
    model = unwrap(chunks[0])
    prompts, params = _prompts(8, seed=3), _params(max_new_tokens=12, temperature=1.0)
    uniforms = torch.rand(8, 12, generator=torch.Generator().manual_seed(7))
    v0 = [p.detach().clone() for p in model.parameters()]
    engine = KVCacheEngine(model, EngineOptions(kv_cache_gib=1.0, context_bucket=8))
    reqs = _requests(prompts, uniforms, [12, 12, 12, 12, 6, 12, 12, 12])
    engine.run_requests(reqs, params, 0, stop=lambda f: bool(f.any()))
    paused = [r for r in reqs if not r.finished]
    assert paused and any(r.finished for r in reqs) and all(r.tokens for r in paused)
    assert engine.stats["decode_live_rows"] > 0
    _perturb(model, 1)
    engine.run_requests(paused, params, 1)
    assert all(r.finished for r in reqs)
    assert len(reqs[4].tokens) <= 6  # its own limit
    both = [r for r in reqs if set(r.versions) == {0, 1}]
    assert both, "no request carries tokens of both versions"
    for r in reqs:
        assert r.versions == sorted(r.versions) and len(r.versions) == len(r.tokens)
    for version, weights in ((1, None), (0, v0)):
        if weights is not None:
            _load(model, weights)
        want, got = _teacher_forced(model, reqs, params, version)
        assert [w[0] for w in want] == [g[0] for g in got]
        torch.testing.assert_close(
            torch.tensor([w[1] for w in want]), torch.tensor([g[1] for g in got]),
            rtol=0, atol=1e-5,
        )  # fmt: skip


@pytest.mark.slow
def test_provenance_kv_recompute_matches_teacher_forcing_per_version():
    run_distributed(_provenance_body, 1)


def _keep_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine

    _, chunks = _model(ParallelConfig())
    model = unwrap(chunks[0])
    prompts, params = _prompts(7, seed=4), _params(max_new_tokens=12)
    uniforms = torch.rand(7, 12, generator=torch.Generator().manual_seed(9))
    v0 = [p.detach().clone() for p in model.parameters()]
    options = EngineOptions(kv_cache_gib=1.0, context_bucket=8)

    # Uninterrupted: the weights change in place when the first request finishes.
    want = _requests(prompts, uniforms)
    swapped = []

    def swap(finished: torch.Tensor) -> bool:
        if bool(finished.any()) and not swapped:
            _perturb(model, 2)
            swapped.append(True)
        return False

    KVCacheEngine(model, options).run_requests(want, params, 0, stop=swap)
    assert swapped
    _load(model, v0)
    # Paused at the same point, the update, resumed from the kept rows.
    got = _requests(prompts, uniforms)
    engine = KVCacheEngine(model, options)
    engine.run_requests(got, params, 0, stop=lambda f: bool(f.any()), keep_kv=True)
    paused = [r for r in got if not r.finished]
    assert paused and all(r.kv is not None for r in paused if r.tokens)
    _perturb(model, 2)
    engine.run_requests(paused, params, 1, keep_kv=True)
    assert engine.stats["prefill_forwards"] == 0  # every paused row came back from the host
    assert engine.stats["kv_recomputed"] == 0
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert any(set(r.versions) == {0, 1} for r in got)
    _keep_into_smaller_cache(model, prompts, uniforms, params, options)


def _keep_into_smaller_cache(model, prompts, uniforms, params, options) -> None:
    """Kept rows beyond a smaller cache (memory taken by an update) are prefilled again, as
    ``recompute`` does, and counted; the kept ones that fit resume from their rows."""
    import dataclasses

    from megatron_grpo.rollout import KVCacheEngine
    from megatron_grpo.rollout.engine.kv_cache import CacheShape

    got = _requests(prompts, uniforms)
    KVCacheEngine(model, options).run_requests(
        got, params, 0, stop=lambda f: bool(f.any()), keep_kv=True
    )
    kept = [r for r in got if not r.finished and r.kv is not None]
    assert len(kept) > 2
    seq_len = -(-(max(len(p) for p in prompts) + params.max_new_tokens) // 8) * 8
    two = 2.5 * CacheShape.of(model).bytes_per_token * seq_len / 2**30  # 2 sequences
    small = KVCacheEngine(model, dataclasses.replace(options, kv_cache_gib=two))
    small.run_requests([r for r in got if not r.finished], params, 1, keep_kv=True)
    assert small.stats["kv_recomputed"] == len(kept) - 2
    assert small.stats["prefill_forwards"] > 0  # the recomputed rows were prefilled
    assert all(r.finished for r in got)


@pytest.mark.slow
def test_kv_keep_equals_uninterrupted_generation_with_the_same_weight_schedule():
    run_distributed(_keep_body, 1)


def test_num_digits_range_is_log_uniform_and_limits_responses():
    from megatron_grpo.rollout.tasks import ReverseDigitsTask

    task = ReverseDigitsTask([2, 64], seed=3)
    prompts = task.prompts(0, 400)
    ks = [len(p.answer) for p in prompts]
    assert min(ks) >= 2 and max(ks) <= 64 and all(p.max_new_tokens == len(p.answer) + 1
                                                  for p in prompts)  # fmt: skip
    assert sum(k <= 11 for k in ks) > sum(k > 11 for k in ks) * 0.6  # log-uniform: ~half <= 11
    assert prompts == ReverseDigitsTask([2, 64], seed=3).prompts(0, 400)  # by index
    fixed = ReverseDigitsTask(3, seed=3).prompts(0, 2)
    assert fixed[0].max_new_tokens is None and len(fixed[0].answer) == 3
