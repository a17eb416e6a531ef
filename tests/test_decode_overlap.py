"""The fused TP decode step in two overlapped halves (rollout/engine/decode_overlap.py): the
decision and its errors, the row split, and at TP 2 the tokens and log-probs of one batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_grpo.rollout.engine import decode_overlap as dov
from megatron_grpo.rollout.engine.tp_all_reduce import TPAllReduce
from tests.dist_utils import run_distributed
from tests.test_rollout import _model, _params, _prompts

CPU = torch.device("cpu")


def test_decision_and_its_errors(monkeypatch):
    from megatron_grpo.rollout import EngineOptions

    assert dov.plan_overlap("off", 4, "fused", False) == 0
    assert dov.plan_overlap("halves", 2, "fused", False) == dov.EXPLICIT_ROWS == 2
    monkeypatch.setattr(dov, "MEASURED_AHEAD", {4: 128})
    assert dov.plan_overlap("auto", 4, "fused", False) == 128
    assert dov.plan_overlap("auto", 2, "fused", False) == 0  # not measured at TP 2
    assert dov.plan_overlap("auto", 4, "modules", False) == 0
    assert dov.plan_overlap("auto", 4, "fused", True) == 0
    for args, why in [
        ((1, "fused", False), "TP is 1"),
        ((2, "modules", False), "decodes through the modules"),
        ((2, "fused", True), "MoE layers"),
    ]:
        with pytest.raises(ValueError, match=f"rollout.engine.decode_overlap 'halves'.*{why}"):
            dov.plan_overlap("halves", *args)
    with pytest.raises(ValueError, match="decode_overlap must be one of.*did you mean 'halves'"):
        EngineOptions(decode_overlap="halve")
    assert dov.describe(0) == "" and "two halves from 2 rows" in dov.describe(2)


def test_halves_split_rows():
    one = TPAllReduce(None, (), CPU)
    halves = dov.HalvesReduce((one, one), 2, CPU)
    assert halves.stream is None  # no second stream on CPU: the halves run in turn
    assert halves.halves(1) == [slice(0, 1)]
    assert halves.halves(2) == [slice(0, 1), slice(1, 2)]
    assert halves.halves(7) == [slice(0, 4), slice(4, 7)]
    assert dov.HalvesReduce((one,), 0, CPU).halves(8) == [slice(0, 8)]
    at_64 = dov.HalvesReduce((one, one), 64, CPU)
    assert at_64.halves(63) == [slice(0, 63)] and len(at_64.halves(64)) == 2
    with pytest.raises(ValueError, match="two halves need two reducers"):
        dov.HalvesReduce((one,), 2, CPU)
    t = torch.ones(3, 4)
    halves.launch(1, t)
    assert halves.wait(1) is t  # TP 1: the sum of one rank


def _generate_both(model, prompts, params, **options):
    """Generations with ``decode_overlap`` off and halves (same seed), checking that the plan
    says which and that only the halves launched a second half's sums."""
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate

    out, launched, real = {}, [], dov.HalvesReduce.launch

    def launch(self, j, t):
        launched.append(j)
        return real(self, j, t)

    for choice in ("off", "halves"):
        o = EngineOptions(context_bucket=8, decode_overlap=choice, **options)
        engine = KVCacheEngine(model, o)
        assert ("two halves" in str(engine.decode)) == (choice == "halves"), engine.decode
        launched.clear()
        dov.HalvesReduce.launch = launch
        try:
            g = torch.Generator().manual_seed(5)
            out[choice] = generate(model, prompts, params, g, engine=engine)
        finally:
            dov.HalvesReduce.launch = real
        assert (1 in launched) == (choice == "halves"), set(launched)
    return out


def _check_same(out, atol: float) -> None:
    assert out["halves"].responses == out["off"].responses
    for a, b in zip(out["halves"].logprobs, out["off"].logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)


def _tp2_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import generate

    _, chunks = _model(ParallelConfig(tensor_model_parallel_size=world))
    model, prompts = unwrap(chunks[0]), _prompts(9, seed=2)
    greedy = _generate_both(model, prompts, _params(top_k=1), kv_cache_gib=1.0)
    sampled = _generate_both(model, prompts, _params(temperature=0.9))
    # a cache of 3 rows: steps of 1-3 rows, split and not, as samples come and go
    per_seq = 2 * 2 * 2 * 16 * 32 * 4 // world  # layers, k/v, kv heads, dim, tokens, fp32
    few = _generate_both(model, prompts, _params(top_k=1), kv_cache_gib=3 * per_seq / 2**30)
    for out in (greedy, sampled, few):
        _check_same(out, atol=1e-5)
    g = torch.Generator().manual_seed(5)
    oracle = generate(model, prompts, _params(top_k=1), g, engine="recompute")
    assert greedy["halves"].responses == oracle.responses


@pytest.mark.slow
def test_tp2_halves_decode_the_one_batch_tokens():
    """TP 2 (gloo): the halves give the one-batch step's greedy and sampled tokens and its
    log-probs, with a cache that holds every sample and with one of 3 slots."""
    run_distributed(_tp2_body, 2)


def _gpu_tp1_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate

    _, chunks = _model(ParallelConfig())
    model, prompts = unwrap(chunks[0]), _prompts(24, seed=3)
    out = {}
    for rows in (0, 2):
        engine = KVCacheEngine(model, EngineOptions(kv_cache_gib=0.5, context_bucket=16))
        assert engine.use_graphs and engine.decode.path == "fused", engine.decode
        # TP 1 has no sum to overlap (an error for a user); forced here, the split and its
        # second stream run inside the captured graphs with the Triton kernels on row ranges
        engine.decode = dataclasses.replace(engine.decode, overlap_rows=rows)
        g = torch.Generator().manual_seed(1)
        out["halves" if rows else "off"] = generate(
            model, prompts, _params(top_k=1), g, engine=engine
        )
        if rows:
            assert engine._all_reduce.stream is not None and engine.stats["decode_steps"] > 0
    _check_same(out, atol=1e-4)


@pytest.mark.gpu
def test_gpu_halves_on_a_second_stream_in_graphs():
    """1 GPU: the halves on their second stream, captured in decode graphs, give the tokens of
    one batch (log-probs within 1e-4: a half's GEMM may round otherwise)."""
    run_distributed(_gpu_tp1_body, 1, backend="nccl", timeout=180)


def _gpu_tp2_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap

    _, chunks = _model(ParallelConfig(tensor_model_parallel_size=world))
    model, prompts = unwrap(chunks[0]), _prompts(40, seed=4)
    for reduce in ("nccl", "one_shot", "two_shot"):
        out = _generate_both(
            model, prompts, _params(top_k=1), kv_cache_gib=0.5, tp_all_reduce=reduce
        )
        _check_same(out, atol=1e-4)


@pytest.mark.gpu
def test_gpu_tp2_halves_decode_the_one_batch_tokens():
    """2 GPUs: a TP 2 engine with decode graphs, the halves overlapped on a second stream, gives
    the one-batch tokens with NCCL's, the one-shot and the two-shot all-reduces."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(_gpu_tp2_body, 2, backend="nccl", timeout=180)
