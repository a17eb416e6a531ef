"""The KV-cached generation engine against the recompute oracle (TP 1/2 with and without SP,
RoPE + GQA + qk-layernorm, learned positions, MoE at EP 2), recorded log-probs against a
teacher-forced training pass, streaming through a cache smaller than the batch, bad input."""

from __future__ import annotations

from types import SimpleNamespace

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


def _compare(
    chunks, prompts, params, *, budget_gib=1.0, multiple=1, forced=True, **options
) -> dict[str, float]:
    """kv_cache == recompute (tokens) on every decode path that covers the model (fused and
    modules), and both record the training pass's log-probs; ``options``: more engine options.
    Returns the last engine's stats."""
    from megatron_grpo.megatron import unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate

    model = unwrap(chunks[0])
    want = generate(model, prompts, params, torch.Generator().manual_seed(5), engine="recompute")
    auto = KVCacheEngine(model).decode.path
    for path in {"modules", auto}:
        o = EngineOptions(kv_cache_gib=budget_gib, context_bucket=8, decode_path=path, **options)
        engine = KVCacheEngine(model, o)
        assert engine.decode.path == path
        got = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)
        _check_generation(chunks, prompts, params, got, want, multiple, forced)
    return engine.stats


def _check_generation(chunks, prompts, params, got, want, multiple, forced) -> None:
    assert got.responses == want.responses, (got.responses, want.responses)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    if forced:
        lps = _teacher_forced(chunks, prompts, got.responses, params.temperature, multiple)
        for a, b in zip(got.logprobs, lps, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    stops = {params.eos_id}
    assert all(r[-1] in stops or len(r) == params.max_new_tokens for r in got.responses)
    assert all(len(lp) == len(r) for lp, r in zip(got.logprobs, got.responses, strict=True))


def _single_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.ops.layers import decode as decode_ops
    from megatron_grpo.rollout import EngineOptions, Generation, KVCacheEngine, generate

    _, chunks = _model(ParallelConfig())  # RoPE, GQA (4 q / 2 kv heads), qk-layernorm
    prompts = _prompts(9)
    _compare(chunks, prompts, _params(top_k=1))  # greedy
    _compare(chunks, prompts, _params(temperature=0.8, top_p=0.9, top_k=30))
    # A cache of 3 sequences for 9 samples: admitted as slots free up, same tokens.
    model = unwrap(chunks[0])
    per_seq = 2 * 2 * 2 * 16 * 32 * 4  # layers * (k, v) * kv heads * head dim * 32 tokens * fp32
    options = EngineOptions(kv_cache_gib=3 * per_seq / 2**30, context_bucket=32)
    looked_up = []  # the decode kernels are looked up once, when the engine is built
    real = decode_ops.decode_kernels
    decode_ops.decode_kernels = lambda impl: looked_up.append(impl) or real(impl)
    try:
        engine = KVCacheEngine(model, options)
        params = _params(top_k=1, max_new_tokens=12)
        got = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)
        again = generate(model, prompts, _params(), torch.Generator().manual_seed(5), engine=engine)
    finally:
        decode_ops.decode_kernels = real
    assert looked_up == [engine.decode.impl] and engine.decode.kernels.sample_rows is None
    assert isinstance(got, Generation) and got.routes is None and again.routes is None
    assert engine.stats["slots"] == 3
    want = generate(model, prompts, params, torch.Generator().manual_seed(5), engine="recompute")
    assert got.responses == want.responses
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
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine

    parallel = ParallelConfig(expert_model_parallel_size=world)
    _, chunks = _model(
        parallel, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type=dispatcher,
    )  # fmt: skip
    # Ranks hold different numbers of prompts and lengths: the group runs in lock step.
    prompts = _prompts(3 + 4 * rank, seed=10 + rank)
    # (The teacher-forced pass would need equal token counts per rank under allgather.)
    # the attention half fused, the MoE block through its module; _compare runs both paths
    assert KVCacheEngine(unwrap(chunks[0])).decode.path == "fused"
    modules = EngineOptions(decode_path="modules")
    assert KVCacheEngine(unwrap(chunks[0]), modules).decode.path == "modules"
    _compare(chunks, prompts, _params(top_k=1), forced=False)
    _compare(chunks, prompts, _params(temperature=0.9), forced=False)
    # Few slots, so samples wait and are admitted between the group's multi-step segments;
    # rows that stop inside a segment stay in the batch until it ends.
    params = _params(temperature=0.9, max_new_tokens=20)
    stats = _compare(chunks, prompts, params, budget_gib=8e-5, forced=False, ep_decode_steps=5)
    assert 1 < stats["slots"] < 3 + 4 * (world - 1), stats  # the last rank waits
    # Prompts admitted over several prefills into free slots: one step between admissions,
    # as at EP 1, not a whole segment (the last prefilled rows would finish segments later).
    params = _params(temperature=0.9, max_new_tokens=12, ignore_eos=True)
    stats = _compare(
        chunks, prompts, params, forced=False, ep_decode_steps=5, max_prefill_tokens=16
    )
    assert stats["decode_steps"] <= params.max_new_tokens - 1 + stats["prefill_forwards"], stats


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["allgather"])  # megatron's alltoall needs CUDA
def test_kv_cache_equals_recompute_moe_ep2(dispatcher):
    run_distributed(_ep_body, 2, dispatcher)


def _ep_tp_body(rank: int, world: int) -> None:
    """The MoE recipes' layout, EP 2 with TP 2 + SP (expert-TP 1): decode's gathered dispatch over
    tokens the same on both ranks, inside the fused step (its attention summed over TP)."""
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import KVCacheEngine
    from tests.ep_utils import cpu_alltoall

    cpu_alltoall()
    parallel = ParallelConfig(
        tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    )  # fmt: skip
    _, chunks = _model(
        parallel, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
    )  # fmt: skip
    assert KVCacheEngine(unwrap(chunks[0])).decode.path == "fused"
    prompts = _prompts(6, seed=30)  # one batch for the TP group
    _compare(chunks, prompts, _params(top_k=1), forced=False)
    params = _params(temperature=0.9, max_new_tokens=16)
    _compare(chunks, prompts, params, forced=False, ep_decode_steps=4)


@pytest.mark.slow
def test_kv_cache_equals_recompute_moe_ep2_tp2_sp():
    run_distributed(_ep_tp_body, 2)


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
    with pytest.raises(ValueError, match="cuda_graphs needs a model whose decode step never syncs"):
        KVCacheEngine(model, EngineOptions(cuda_graphs=True))
    with pytest.raises(ValueError, match="decode path must be one of"):
        KVCacheEngine(model, EngineOptions(decode_path="fast"))
    with pytest.raises(ValueError, match="decode impl 'triton' needs the model on GPU"):
        KVCacheEngine(model, EngineOptions(decode_impl="triton"))
    _, chunks = _model(ParallelConfig(), normalization="LayerNorm")
    assert KVCacheEngine(unwrap(chunks[0])).decode.reason == "normalization=LayerNorm"


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
            assert got.responses == want.responses
        forced = _teacher_forced(chunks, prompts, got.responses, params.temperature, 1)
        tol = 1e-4 if dtype == "float32" else 0.1  # bf16: per-forward rounding of activations
        for a, b in zip(got.logprobs, forced, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=tol)


def test_compaction_moves_each_row_from_where_its_cache_is():
    """Finished rows are refilled by the last rows in one batched copy (every source read before
    any write): a row moved into a slot that later moves on again must come from its origin."""
    from types import SimpleNamespace

    from megatron_grpo.rollout.engine.kv_engine import KVCacheEngine
    from megatron_grpo.rollout.engine.run_state import Run

    for finished in ([1, 3], [0, 2, 3], [1, 2, 4, 5], [0, 5], [4]):
        slots = list(range(6))  # slot i holds the cache of sample i
        run = Run.__new__(Run)  # only its rows take part
        run.rows = list(range(6))

        def move_rows(src, dst, ctx, slots=slots):
            moved = [slots[s] for s in src]  # batched: read everything first
            for d, v in zip(dst, moved, strict=True):
                slots[d] = v

        engine = SimpleNamespace(
            cache=SimpleNamespace(move_rows=move_rows, seq_len=8), _rows_moved=False
        )
        KVCacheEngine._retire(engine, run, finished)
        assert sorted(run.rows) == sorted(set(range(6)) - set(finished))
        assert [slots[r] for r in range(len(run.rows))] == run.rows, (finished, slots, run.rows)


@pytest.mark.parametrize(
    ("env", "found"),
    [
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": ""}, False),
    ],
)
def test_expandable_segments_turn_decode_graphs_off(monkeypatch, env, found):
    """Decode graph capture stalled under expandable segments (measured on 2 H200s): auto
    graphs are off with the reason in the start-up line; explicit graphs are an error."""
    from megatron_grpo.megatron.layout import ParallelLayout
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine
    from megatron_grpo.rollout.engine import kv_engine as engine_mod
    from megatron_grpo.rollout.engine.fused_decode import DecodePlan
    from megatron_grpo.rollout.engine.graphs import (
        ALLOC_CONF_VARS,
        expandable_segments,
        plan_graphs,
    )

    for name in ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (expandable_segments() is not None) == found
    if not found:
        return
    assert expandable_segments().startswith(next(iter(env)) + "=")
    model = SimpleNamespace(config=SimpleNamespace(num_moe_experts=None))  # a dense GPU model
    assert plan_graphs(model, None, cuda=True) == (False, f"off: {expandable_segments()}")
    with pytest.raises(ValueError, match="decode graphs do not capture with .*expandable"):
        plan_graphs(model, True, cuda=True)
    assert plan_graphs(model, False, cuda=True) == (False, "")
    # the engine carries the decision in its decode plan
    monkeypatch.setattr(engine_mod.io, "model_device", lambda m: torch.device("cuda"))
    plan = DecodePlan("modules", "torch", SimpleNamespace(sample_rows=None), "chosen")
    monkeypatch.setattr(engine_mod.fd, "plan_decode", lambda *a, **k: plan)
    engine = KVCacheEngine(model, EngineOptions(), layout=ParallelLayout())
    assert not engine.use_graphs and engine.graphs is None and not engine.decode.graphs
    assert engine.graphs_off == engine.decode.graphs_off == f"off: {expandable_segments()}"


def test_steps_left_bounds_the_expert_groups_segments():
    """An EP segment never runs past a row's length limit: the fewest steps any next-step row
    (active, or prefilled now: fresh ones get their first token there) has before its limit."""
    from megatron_grpo.rollout.engine.run_state import Run

    params = _params(max_new_tokens=10)
    run = Run.start([[1, 2], [3], [4, 5, 6]], params, torch.rand(3, 10), [10, 4, None])
    assert run.steps_left([]) == 1  # nothing to decode
    assert run.steps_left([0, 1, 2]) == 3  # fresh: sample 1 holds 1 of its 4 after prefill
    run.rows, run.lengths[0], run.lengths[2] = [0, 2], 7, 2
    assert run.steps_left([]) == 3  # sample 0: 3 more tokens
    run.lengths[1] = 2  # resumed with 2 tokens (its last is fed by the next step)
    assert run.steps_left([1]) == 2
    run.lengths[0] = 10  # at its limit (finished): still at least one step
    assert run.steps_left([]) == 1
