"""The KV-cached generation engine against the recompute oracle (TP 1/2 with and without SP,
RoPE + GQA + qk-layernorm, learned positions, MoE at EP 2), recorded log-probs against a
teacher-forced training pass, streaming through a cache smaller than the batch, bad input."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.rollout import SamplingParams
from tests.dist_utils import run_distributed

VOCAB = 100


def _params(**kw) -> SamplingParams:
    base = dict(temperature=1.0, top_p=1.0, max_new_tokens=12, eos_id=3, vocab_size=VOCAB)
    return SamplingParams(**{**base, **kw})


def _prompts(n: int, seed: int = 0, longest: int = 13) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


def _model(parallel, **kw):
    from tests.megatron_utils import build_layout, tiny_model

    cfg = tiny_model(init_method_std=0.3, **kw)  # peaked: responses differ, eos occurs
    return cfg, build_layout(parallel, cfg)


def _teacher_forced(chunks, prompts, responses, temperature, multiple) -> list[list[float]]:
    """The training engine's log-probs of the generated tokens (GRPOStep, same temperature)."""
    from megatron_grpo.loss import GRPOLossConfig
    from megatron_grpo.megatron import GRPOStep, pack_sequences

    seqs = [torch.tensor(p + r) for p, r in zip(prompts, responses, strict=True)]
    masks = [
        torch.tensor([False] * len(p) + [True] * len(r))
        for p, r in zip(prompts, responses, strict=True)
    ]
    batch = pack_sequences(seqs, masks, pad_to_multiple_of=multiple)
    step = GRPOStep(GRPOLossConfig(), vocab_size=VOCAB, temperature=temperature, impl="torch")
    [lp] = step.compute_logprobs(chunks, [batch])
    out, start = [], 0
    for p, r in zip(prompts, responses, strict=True):
        out.append(lp[start + len(p) - 1 : start + len(p) + len(r) - 1].tolist())
        start += len(p) + len(r)
    return out


def _compare(chunks, prompts, params, *, budget_gib=1.0, multiple=1, forced=True) -> None:
    """kv_cache == recompute (tokens), and both record the training pass's log-probs."""
    from megatron_grpo.megatron import unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate

    model = unwrap(chunks[0])
    engine = KVCacheEngine(model, EngineOptions(kv_cache_gib=budget_gib, context_bucket=8))
    want = generate(model, prompts, params, torch.Generator().manual_seed(5), engine="recompute")
    got = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)
    assert got[0] == want[0], (got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    if forced:
        lps = _teacher_forced(chunks, prompts, got[0], params.temperature, multiple)
        for a, b in zip(got[1], lps, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    stops = {params.eos_id}
    assert all(r[-1] in stops or len(r) == params.max_new_tokens for r in got[0])
    assert all(len(lp) == len(r) for lp, r in zip(got[1], got[0], strict=True))


def _single_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate

    _, chunks = _model(ParallelConfig())  # RoPE, GQA (4 q / 2 kv heads), qk-layernorm
    prompts = _prompts(9)
    _compare(chunks, prompts, _params(top_k=1))  # greedy
    _compare(chunks, prompts, _params(temperature=0.8, top_p=0.9, top_k=30))
    # A cache of 3 sequences for 9 samples: admitted as slots free up, same tokens.
    model = unwrap(chunks[0])
    per_seq = 2 * 2 * 2 * 16 * 32 * 4  # layers * (k, v) * kv heads * head dim * 32 tokens * fp32
    options = EngineOptions(kv_cache_gib=3 * per_seq / 2**30, context_bucket=32)
    engine = KVCacheEngine(model, options)
    params = _params(top_k=1, max_new_tokens=12)
    got = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)
    assert engine.stats["slots"] == 3
    want = generate(model, prompts, params, torch.Generator().manual_seed(5), engine="recompute")
    assert got[0] == want[0]
    # YaRN (its attention factor applied to cos / sin as megatron-core does).
    _, chunks = _model(
        ParallelConfig(), position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=16,
    )  # fmt: skip
    _compare(chunks, prompts, _params(top_k=1))
    # Learned absolute positions (the tiny recipe's model), MHA.
    _, chunks = _model(
        ParallelConfig(), position_embedding_type="learned_absolute", num_query_groups=None
    )
    _compare(chunks, prompts, _params(top_k=1))


@pytest.mark.slow
def test_kv_cache_equals_recompute_and_training_logprobs_tp1():
    run_distributed(_single_body, 1)


def _tp_body(rank: int, world: int, sequence_parallel: bool) -> None:
    import torch.distributed as dist

    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import generate

    parallel = ParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sequence_parallel)
    _, chunks = _model(parallel)
    prompts = _prompts(7, seed=1)
    _compare(chunks, prompts, _params(top_k=1), multiple=world if sequence_parallel else 1)
    params = _params(temperature=1.2)
    out = generate(unwrap(chunks[0]), prompts, params, torch.Generator().manual_seed(3))
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    assert all(g == gathered[0] for g in gathered), "TP ranks sampled different tokens"
    assert unwrap(chunks[0]).config.sequence_parallel == sequence_parallel  # restored


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_kv_cache_equals_recompute_tp2(sequence_parallel):
    run_distributed(_tp_body, 2, sequence_parallel)


def _ep_body(rank: int, world: int, dispatcher: str) -> None:
    from megatron_grpo.megatron import ParallelConfig

    parallel = ParallelConfig(expert_model_parallel_size=world)
    _, chunks = _model(
        parallel, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type=dispatcher,
    )  # fmt: skip
    # Ranks hold different numbers of prompts and lengths: the group runs in lock step.
    prompts = _prompts(3 + 4 * rank, seed=10 + rank)
    # (The teacher-forced pass would need equal token counts per rank under allgather.)
    _compare(chunks, prompts, _params(top_k=1), forced=False)
    _compare(chunks, prompts, _params(temperature=0.9), forced=False)


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["allgather"])  # megatron's alltoall needs CUDA
def test_kv_cache_equals_recompute_moe_ep2(dispatcher):
    run_distributed(_ep_body, 2, dispatcher)


def _errors_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate

    cfg, chunks = _model(ParallelConfig())
    model, g = unwrap(chunks[0]), torch.Generator()
    limit = cfg.max_sequence_length - 12
    cases = [
        ([[1, 2], []], "prompt 1 is empty"),
        ([[5] * (limit + 1)], f"prompt 0 has {limit + 1} tokens > max_sequence_length"),
        ([[1, VOCAB]], f"token id {VOCAB} outside the vocabulary"),
        ([[1, -1]], "token id -1 outside"),
        ([], "no prompts"),
    ]
    for engine in ("kv_cache", "recompute"):
        for prompts, match in cases:
            with pytest.raises(ValueError, match=match):
                generate(model, prompts, _params(), g, engine=engine)
    with pytest.raises(ValueError, match="kv_cache_gib=1e-06 is too small for one sequence"):
        KVCacheEngine(model, EngineOptions(kv_cache_gib=1e-6)).generate([[1]], _params(), g)
    with pytest.raises(ValueError, match="engine must be one of"):
        generate(model, [[1]], _params(), g, engine="vllm")
    with pytest.raises(ValueError, match="cuda_graphs needs a dense model on GPU"):
        KVCacheEngine(model, EngineOptions(cuda_graphs=True))


@pytest.mark.slow
def test_bad_input_names_the_value():
    run_distributed(_errors_body, 1)


@pytest.mark.gpu
def test_gpu_graphs_equal_recompute_and_training_logprobs():
    """On one GPU: greedy tokens of the CUDA-graph engine equal the recompute oracle's (fp32
    weights), graphs are reused across calls, and bf16 records the training log-probs."""
    run_distributed(_gpu_body, 1, backend="nccl")


def _gpu_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate

    prompts = _prompts(40, seed=2)
    for dtype in ("float32", "bfloat16"):
        _, chunks = _model(ParallelConfig(), params_dtype=dtype)
        model = unwrap(chunks[0])
        params = _params(top_k=1) if dtype == "float32" else _params(temperature=0.9)
        for keep in (True, False):
            options = EngineOptions(kv_cache_gib=1.0, context_bucket=16, keep_cache=keep)
            engine = KVCacheEngine(model, options)
            assert engine.use_graphs
            got = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)
            captures = engine.graphs.captures
            assert captures > 1
            again = generate(
                model, prompts, params, torch.Generator().manual_seed(5), engine=engine
            )
            assert again == got
            if keep:  # the cache stayed where the graphs read it: none captured again
                assert engine.graphs.captures == captures
        if dtype == "float32":
            want = generate(
                model, prompts, params, torch.Generator().manual_seed(5), engine="recompute"
            )
            assert got[0] == want[0]
        forced = _teacher_forced(chunks, prompts, got[0], params.temperature, 1)
        tol = 1e-4 if dtype == "float32" else 0.1  # bf16: per-forward rounding of activations
        for a, b in zip(got[1], forced, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=tol)


def test_compaction_moves_a_row_moved_twice_from_its_origin():
    """Rows [A, B, C, D] with A and C finished: D moves into C's slot, then on into A's; its
    cache must come from D's slot (one batched copy reads all slots before writing)."""
    from types import SimpleNamespace

    from megatron_grpo.rollout import KVCacheEngine
    from megatron_grpo.rollout.kv_cache import CacheShape, KVCache

    cache = KVCache(CacheShape(1, 1, 2, torch.float32), slots=4, seq_len=4, device="cpu")
    for slot in range(4):
        cache.kv[:, :, slot] = float(slot)
    engine = KVCacheEngine.__new__(KVCacheEngine)
    engine.cache = cache
    run = SimpleNamespace(rows=[10, 11, 12, 13], done=lambda i: i in (10, 12))
    engine._retire(run)
    assert run.rows == [13, 11]
    assert cache.kv[0, 0, 0].unique().tolist() == [3.0]  # D's cache
    assert cache.kv[0, 0, 1].unique().tolist() == [1.0]  # B stays
