"""``rollout.colocated.weights: replica``: each rank of a TP group generates its share of the
samples on its own TP = EP = 1 copy of the policy, gathered from the trained shards before every
call. At TP 2 + SP with EP 2 (gloo) the gathered batch equals one TP 1 engine's over all samples
(tokens, log-probs within 1e-5, routes), greedy and sampled, and after the trained weights change
the next call generates with the new ones. On 2 GPUs (NCCL, bf16) the replica decodes in CUDA
graphs and samples what a TP 1 engine samples:

    python -m pytest -q -m gpu tests/test_replica_generation.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_grpo.megatron import ParallelConfig, unwrap
from megatron_grpo.rollout.replica import share
from tests.dist_utils import run_distributed
from tests.ep_utils import cpu_alltoall
from tests.megatron_utils import build_layout, full_params, load_full, tiny_model

OPTIONS = dict(kv_cache_gib=0.01, context_bucket=16)


def _cfg():
    return tiny_model(
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall", moe_enable_routing_replay=True,
    )  # fmt: skip


def _params(top_k: int):
    from megatron_grpo.rollout.engine.params import SamplingParams

    return SamplingParams(temperature=1.0, top_k=top_k, max_new_tokens=5, eos_id=3, vocab_size=100)


def _run(model, engine, prompts, top_k):
    from megatron_grpo.rollout import generate

    gen = torch.Generator().manual_seed(5)  # the same on the TP ranks (one model replica)
    return generate(model, prompts, _params(top_k), gen, engine=engine, record_routes=True)


def _reference(weights, cfg, prompts):
    """Greedy and sampled generations of one TP 1 engine over every prompt."""
    from megatron_grpo.megatron.layout import ParallelLayout
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine

    ref = unwrap(build_layout(ParallelConfig(), cfg)[0])
    load_full([ref], weights, cfg)
    engine = KVCacheEngine(ref, EngineOptions(**OPTIONS), layout=ParallelLayout())
    return [_run(ref, engine, prompts, k) for k in (1, 0)]


def _tp2_sp_ep2(cfg, weights):
    """The trained model at TP 2 + SP with EP 2 (expert-TP 1), holding ``weights``: its chunks
    and unwrapped first chunk."""
    par = ParallelConfig(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True,
        expert_tensor_parallel_size=1,
    )  # fmt: skip
    chunks = build_layout(par, cfg)
    load_full(chunks, weights, cfg)
    return chunks, unwrap(chunks[0])


def _same(got, want):
    assert got.responses == want.responses
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5)
    for a, b in zip(got.routes, want.routes, strict=True):
        assert torch.equal(a, b)


def _body(rank, world):
    from megatron_grpo.megatron.plan.generation import replica_bytes
    from megatron_grpo.rollout import EngineOptions
    from megatron_grpo.rollout.replica import ReplicaEngine

    cpu_alltoall()
    cfg = _cfg()
    g = torch.Generator().manual_seed(3)  # the same prompts on both ranks: one TP group
    prompts = [torch.randint(4, 100, (int(n),), generator=g).tolist() for n in (3, 7, 4, 5, 6)]
    weights = full_params(build_layout(ParallelConfig(), cfg))
    wants = _reference(weights, cfg, prompts)
    chunks, model = _tp2_sp_ep2(cfg, weights)
    engine = ReplicaEngine(model, cfg, EngineOptions(**OPTIONS), max_context=32)
    held = sum(p.numel() * p.element_size() for p in engine.replica.parameters())
    assert held == replica_bytes(cfg, torch.float32)  # what the dry run and offload plan with
    for top_k, want in zip((1, 0), wants, strict=True):
        _same(_run(model, engine, prompts, top_k), want)
    lo, hi = share(len(prompts), rank, world)
    assert engine.stats["generated_tokens"] == sum(len(r) for r in wants[1].responses[lo:hi])
    # the trained weights change (an update): the next call generates with the new ones
    changed = {k: v * 0.5 if "linear" in k else v for k, v in weights.items()}
    load_full(chunks, changed, cfg)
    want = _reference(changed, cfg, prompts)[1]
    assert want.responses != wants[1].responses  # the change is visible in the tokens
    _same(_run(model, engine, prompts, 0), want)


def test_replica_generation_tp2_sp_ep2_equals_one_tp1_engine():
    run_distributed(_body, 2, timeout=300)


@pytest.mark.parametrize("n,size", [(5, 2), (4, 2), (1, 2), (0, 3), (7, 4)])
def test_share_covers_the_samples_in_order(n, size):
    spans = [share(n, r, size) for r in range(size)]
    assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(n))
    assert max(hi - lo for lo, hi in spans) - min(hi - lo for lo, hi in spans) <= 1


@pytest.mark.parametrize(
    "overrides,needs",
    [
        (["rollout.engine.kind=recompute"], "engine.kind: kv_cache"),
        (["rollout.input_path=/tmp/x.jsonl"], "source: generate"),
        (
            ["rollout.placement=separate", "rollout.separate.generation_ranks=1"],
            "placement: colocated",
        ),
    ],
)
def test_replica_config_errors_name_the_field(overrides, needs):
    from megatron_grpo.config import ConfigError
    from megatron_grpo.train.config import load_train_config

    with pytest.raises(
        (ConfigError, ValueError), match=f"colocated.weights: replica needs {needs}"
    ):
        load_train_config("recipes/tiny.yaml", ["rollout.colocated.weights=replica", *overrides])


def test_replica_choice_is_checked_and_reaches_the_context():
    from megatron_grpo.config import ConfigError
    from megatron_grpo.rollout.placement import ColocatedConfig
    from megatron_grpo.train.config import load_train_config

    cfg = load_train_config("recipes/tiny.yaml", ["rollout.colocated.weights=replica"])
    assert cfg.rollout.colocated.weights == "replica"
    assert cfg.rollout_context().model_config is cfg.model
    with pytest.raises(ValueError, match="weights must be one of shared, replica"):
        ColocatedConfig(weights="copy")
    with pytest.raises(
        (ConfigError, ValueError), match="rollout.colocated.weights: 'copy' is not one of"
    ):
        load_train_config("recipes/tiny.yaml", ["rollout.colocated.weights=copy"])


def test_dry_run_states_the_replica():
    import io

    from megatron_grpo.megatron.plan.generation import replica_bytes
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.dry_run import dry_run

    cfg = load_train_config("recipes/tiny.yaml", ["rollout.colocated.weights=replica"])
    text = dry_run(cfg, 2, file=io.StringIO()).text
    gib = replica_bytes(cfg.model) / 2**30
    assert f"generation replica (rollout.colocated.weights: replica): {gib:.2f} GiB" in text


def _gpu_body(rank, world):
    from megatron_grpo.megatron.layout import ParallelLayout
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine
    from megatron_grpo.rollout.replica import ReplicaEngine

    cfg = tiny_model(
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall", params_dtype="bfloat16",
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 100, (int(n),), generator=g).tolist() for n in range(3, 40)]
    ref = unwrap(build_layout(ParallelConfig(), cfg)[0])
    weights = full_params([ref])
    options = EngineOptions(kv_cache_gib=1.0, context_bucket=16)
    one = KVCacheEngine(ref, options, layout=ParallelLayout())
    params = _params(1)
    want = _generate_plain(ref, one, prompts, params)
    chunks, model = _tp2_sp_ep2(cfg, weights)
    engine = ReplicaEngine(model, cfg, options, max_context=64)
    assert engine.use_graphs, engine.graphs_off
    got = _generate_plain(model, engine, prompts, params)
    assert engine.engine.graphs.captures > 0
    same = sum(a == b for a, b in zip(got.responses, want.responses, strict=True))
    assert same >= len(prompts) - 2, f"{same} of {len(prompts)} greedy responses agree"


def _generate_plain(model, engine, prompts, params):
    from megatron_grpo.rollout import generate

    return generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_gpu_replica_decodes_in_graphs_as_one_tp1_engine():
    """2 GPUs: TP 2 + SP, EP 2, bf16: the replicas capture their decode steps in CUDA graphs
    and their greedy tokens are one TP 1 engine's (but for up to 2 near-tie flips)."""
    run_distributed(_gpu_body, 2, backend="nccl", timeout=600)


def _whole_body(rank, world):
    from megatron_grpo.megatron.model.replica import build_replica
    from megatron_grpo.rollout import KVCacheEngine
    from megatron_grpo.rollout.source import build_engine
    from megatron_grpo.train.config import load_train_config

    cfg = load_train_config(
        "recipes/tiny.yaml",
        ["rollout.colocated.weights=replica", "parallel.tensor_model_parallel_size=1"],
    )
    model = unwrap(build_layout(ParallelConfig(), cfg.model)[0])
    engine = build_engine(cfg.rollout, model, cfg.rollout_context())
    assert isinstance(engine, KVCacheEngine) and engine.model is model
    # the context's model section may still say recompute "auto" (resolved later, for training)
    auto = dataclasses.replace(cfg.model, recompute_granularity="auto")
    assert build_replica(auto).config.recompute_granularity is None


def test_replica_at_tp1_ep1_decodes_on_the_trained_model():
    """At TP = EP = 1 the trained model is whole on each rank: no copy is built."""
    run_distributed(_whole_body, 2, timeout=300)


def test_replica_copy_matches_tensors_by_key_and_names_a_mismatch():
    from megatron_grpo.rollout.weight_sync.replica_copy import _match
    from megatron_grpo.rollout.weight_sync.shards import SyncTensor

    def t(key, *shape, vocab=False):
        return SyncTensor(key, [torch.zeros(shape)], False, (), vocab)

    trained = [t("emb", 16, 4, vocab=True), t("w", 4, 4)]
    replica = [t("w", 4, 4), t("emb", 8, 4, vocab=True)]  # vocabulary rows: padded per TP size
    shapes = [(16, 4), (4, 4)]
    assert [r.key for r in _match(trained, shapes, replica)] == ["emb", "w"]
    with pytest.raises(ValueError, match=r"generation replica: w is \(4, 3\)"):
        _match(trained, shapes, [replica[1], t("w", 4, 3)])
    with pytest.raises(ValueError, match="no tensor w"):
        _match(trained, shapes, [replica[1]])
    with pytest.raises(ValueError, match=r"lacks: \['bias'\]"):
        _match(trained, shapes, [*replica, t("bias", 4)])
