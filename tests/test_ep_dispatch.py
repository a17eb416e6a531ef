"""The gathered expert-parallel dispatch (``moe.ep_dispatch``) against megatron-core's
all-to-all dispatcher on the same weights and routes: outputs, input, expert and router
gradients; top-k 1 / 2 / 8, an expert without tokens, every token on one rank's experts; EP 2,
EP 4, TP 2 + SP with EP 2, and the replicated tokens of generation (TP 2 without SP). Greedy
generation at EP 2 equals EP 1 token for token, merged log-prob passes unmerged ones."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state

from megatron_grpo.megatron import ParallelConfig, unwrap
from megatron_grpo.megatron.moe.ep_dispatch import (
    EPDispatch,
    GatheredTokenDispatcher,
    choose_dispatch,
    no_host_sync,
)
from tests.dist_utils import run_distributed
from tests.ep_utils import cpu_alltoall, switch_dispatch
from tests.megatron_utils import build_layout, full_params, load_full, tiny_model

H, E = 64, 8


def _cfg(topk: int, **kw):
    kw.setdefault("num_layers", 1)
    return tiny_model(
        num_moe_experts=E, moe_router_topk=topk, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
        moe_router_pre_softmax=topk == 1, moe_token_dispatcher_type="alltoall", **kw,
    )  # fmt: skip


def _forced_router(router, ids_of):
    """The router's own scores (softmax of its logits: gradients reach its weight) gathered at
    the ids ``ids_of(T)`` gives (None: its own top-k)."""

    def forward(x, *args, **kwargs):
        logits = x.reshape(-1, x.size(-1)).float() @ router.weight.float().T
        scores = torch.softmax(logits, dim=-1)
        ids = ids_of(scores.size(0))
        if ids is None:
            ids = torch.topk(scores, router.topk, dim=1).indices
        probs = torch.zeros_like(scores).scatter(1, ids, scores.gather(1, ids))
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, ids, True)
        return probs, routing_map

    return forward


def _routes(mode: str, topk: int, rank: int, ep: int):
    g = torch.Generator().manual_seed(11 + rank)
    local = E // ep

    drawn: dict[int, torch.Tensor] = {}  # the same routes in every forward

    def ids_of(t: int):
        if mode == "live":
            return None
        if mode == "zero":  # expert 1 (EP rank 0's) gets no token from anyone
            pool = torch.tensor([e for e in range(E) if e != 1])
        else:  # "one_rank": every token to the last EP rank's experts
            pool = torch.arange(E - local, E)
        if t not in drawn:
            perms = [torch.randperm(len(pool), generator=g)[:topk] for _ in range(t)]
            drawn[t] = torch.stack([pool[p] for p in perms])
        return drawn[t]

    return ids_of


def _run(mlp, x, gy, params):
    xi = x.clone().requires_grad_()
    out, _ = mlp(xi)
    grads = torch.autograd.grad(out, [xi, *params], gy, allow_unused=True)
    return [out.detach(), *grads]


def _check_case(rank, chunks, ep, topk, mode, replicated, tokens=5):
    mlp = unwrap(chunks[0]).decoder.layers[0].mlp
    assert isinstance(mlp.ep_dispatch, EPDispatch)
    assert isinstance(mlp.ep_dispatch.gathered, GatheredTokenDispatcher)
    mlp.router.topk = topk
    mlp.ep_dispatch.gathered.topk = mlp.ep_dispatch.megatron.config.moe_router_topk = topk
    mlp.router.forward = _forced_router(mlp.router, _routes(mode, topk, rank, ep))
    gathered = mlp.ep_dispatch.gathered
    same = gathered.replicated() or gathered.tp_sliced()
    assert same == replicated
    # generation under TP without SP: the same tokens on the ranks of a TP group
    seed = (parallel_state.get_data_parallel_rank() if replicated else rank) + 100 * topk
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 1, H, generator=g)
    gy = torch.randn(tokens, 1, H, generator=g)
    params = [mlp.router.weight, mlp.experts.weight1, mlp.experts.weight2]
    if replicated:  # expert grads: megatron's dispatcher counts each copy (training refuses it)
        params = [mlp.router.weight]
    from megatron.core.transformer.moe import token_dispatcher

    sort_permute = token_dispatcher.permute  # installed by the layer (alltoall_permute)
    got = {}
    for choice in ("megatron", "alltoall", "gathered"):
        # "megatron": the all-to-all dispatcher with its own mask-based permute, the reference
        megatron_permute = getattr(sort_permute, "megatron_permute", sort_permute)  # 0.19: kept
        token_dispatcher.permute = megatron_permute if choice == "megatron" else sort_permute
        assert switch_dispatch(chunks, "alltoall" if choice == "megatron" else choice) == 1
        want = "gathered" if choice == "gathered" else "megatron"
        assert mlp.ep_dispatch.resolve() == want
        got[choice] = _run(mlp, x, gy, params)
    token_dispatcher.permute = sort_permute
    names = ["output", "input grad", "router grad", "fc1 grad", "fc2 grad"]
    for choice in ("alltoall", "gathered"):
        for name, a, b in zip(names, got[choice], got["megatron"], strict=False):
            scale = max(1.0, b.abs().max().item())
            err = (a - b).abs().max().item()
            what = f"rank {rank} {choice} top-{topk} {mode} {name}"
            assert err <= 1e-5 * scale, f"{what}: {err:.3e} (scale {scale:.2e})"
    if mode == "zero" and mlp.ep_dispatch.gathered.local_offset == 0:
        assert got["gathered"][3][1].abs().max() == 0  # expert 1: no token, no gradient


def _layer_body(rank, world, parallel, cases):
    """Every case on one model (the router's top-k set per case; one spawn per layout)."""
    cpu_alltoall()
    chunks = build_layout(parallel, _cfg(8))
    ep = parallel.expert_model_parallel_size
    for topk, mode in cases:
        _check_case(rank, chunks, ep, topk, mode, replicated=False)
    if parallel.tensor_model_parallel_size > 1:  # generation: SP off, the same tokens
        from megatron.core.transformer.utils import set_model_to_sequence_parallel

        set_model_to_sequence_parallel(unwrap(chunks[0]), False)
        unwrap(chunks[0]).eval()
        gathered = unwrap(chunks[0]).decoder.layers[0].mlp.ep_dispatch.gathered
        _check_case(rank, chunks, ep, 2, "live", replicated=True)
        if gathered.tp_sliced():  # 7 tokens: TP padding rows, routed to no expert
            _check_case(rank, chunks, ep, 8, "live", replicated=True, tokens=7)


EP2 = ParallelConfig(expert_model_parallel_size=2)
EP4 = ParallelConfig(expert_model_parallel_size=4)
TP2_SP_EP2 = ParallelConfig(
    tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
    expert_tensor_parallel_size=1,
)  # fmt: skip
TP2_EP4 = ParallelConfig(
    tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=4,
    expert_tensor_parallel_size=1,
)  # fmt: skip
ALL_MODES = [(1, "live"), (2, "live"), (8, "live"), (1, "zero"), (2, "zero"), (2, "one_rank")]


@pytest.mark.parametrize(
    "parallel, world, cases",
    [
        pytest.param(EP2, 2, ALL_MODES, id="ep2"),
        pytest.param(EP4, 4, [(2, "zero"), (2, "one_rank"), (8, "live")], id="ep4"),
        pytest.param(TP2_SP_EP2, 2, [(2, "live"), (1, "zero")], id="tp2_sp_ep2"),
        pytest.param(TP2_EP4, 4, [(2, "one_rank")], id="tp2_sp_ep4"),
    ],
)
def test_gathered_dispatch_equals_alltoall(parallel, world, cases):
    """Outputs, input / router / expert gradients equal megatron-core's all-to-all dispatcher's
    (fp32); TP 2 + SP also with SP off and the same tokens on both ranks (generation)."""
    run_distributed(_layer_body, world, parallel, cases)


def test_choose_dispatch_is_one_decision():
    assert choose_dispatch("auto", False, None) == "megatron"
    assert choose_dispatch("auto", True, None) == "gathered"
    assert choose_dispatch("auto", True, "expert_tensor_parallel_size=2") == "megatron"
    assert choose_dispatch("alltoall", True, None) == "megatron"
    assert choose_dispatch("gathered", False, None) == "gathered"
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2"):
        choose_dispatch("gathered", False, "expert_tensor_parallel_size=2")
    with pytest.raises(ValueError, match="one of"):
        choose_dispatch("ragged", True, None)


def _generate(model, prompts, rank):
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate
    from megatron_grpo.rollout.engine.params import SamplingParams

    params = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6, eos_id=3, vocab_size=100)
    engine = KVCacheEngine(model, EngineOptions(kv_cache_gib=0.01, context_bucket=16))
    return generate(model, prompts, params, torch.Generator().manual_seed(rank), engine=engine)


def _generation_body(rank, world):
    from megatron_grpo.megatron.moe.local_dispatch import host_sync_reason

    cpu_alltoall()
    cfg = _cfg(2, num_layers=2)
    ref = build_layout(ParallelConfig(), cfg)  # EP 1 (DP 2): every expert on each rank
    weights = full_params(ref)
    g = torch.Generator().manual_seed(20 + rank)  # ranks hold different prompts and counts
    prompts = [torch.randint(0, 100, (int(n),), generator=g).tolist() for n in range(3, 6 + rank)]
    want = _generate(unwrap(ref[0]), prompts, rank)
    chunks = build_layout(ParallelConfig(expert_model_parallel_size=2), cfg)
    load_full(chunks, weights, cfg)
    model = unwrap(chunks[0])
    assert host_sync_reason(model) is None  # decode steps: the gathered dispatch
    calls = []
    gathered = model.decoder.layers[0].mlp.ep_dispatch.gathered
    original = gathered.dispatch_preprocess

    def counted(*args):
        calls.append(1)
        return original(*args)

    gathered.dispatch_preprocess = counted
    got = _generate(model, prompts, rank)
    assert calls, "decode did not take the gathered dispatch"
    assert got.responses == want.responses
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5)
    from tests.test_ep_logprobs import check_merged_logprobs

    check_merged_logprobs(rank, ref, chunks, cfg)
    switch_dispatch(chunks, "alltoall")
    assert "alltoall" in host_sync_reason(model)
    with no_host_sync(model):
        assert model.decoder.layers[0].mlp.ep_dispatch.resolve() == "megatron"


def test_greedy_generation_and_merged_logprobs_ep2_equal_ep1():
    """Greedy generation at EP 2 (decode through the gathered dispatch) equals EP 1 token for
    token; log-prob passes merged at EP 2 equal unmerged ones with uneven micro-batch counts
    (``test_ep_logprobs.check_merged_logprobs``)."""
    run_distributed(_generation_body, 2, timeout=300)


def test_sort_permute_equals_megatron_permute():
    """The all-to-all dispatcher's permutation by sort (no ``masked_select`` host syncs) gives
    megatron-core's rows, probs and token indices; token dropping keeps megatron-core's."""
    from megatron.core.transformer.moe.moe_utils import permute

    from megatron_grpo.megatron.moe.alltoall_permute import make_sort_permute

    g = torch.Generator().manual_seed(3)
    t, e, k = 9, 6, 2
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[:, 0] = 4  # every token on expert 4, none on some others
    ids[:, 1] = torch.where(ids[:, 1] == 4, 0, ids[:, 1])
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.rand(t, e, generator=g) * routing_map
    x = torch.randn(t, 5, generator=g, requires_grad=True)
    calls = []
    sort_permute = make_sort_permute(lambda *a: calls.append(1) or permute(*a))
    got = sort_permute(x, routing_map, probs=probs, num_out_tokens=t * k)
    want = permute(x, routing_map, probs=probs, num_out_tokens=t * k)
    assert not calls
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    (gx,) = torch.autograd.grad(got[0], x, torch.ones_like(got[0]))
    assert torch.equal(gx, torch.full_like(x, float(k)))
    sort_permute(x, routing_map, probs=probs, num_out_tokens=torch.tensor(t * k))  # a tensor
    assert calls == [1]


def test_gathered_decode_width_counts_fixed_buffers():
    """The engine's per-slot headroom (kv_cache.Headroom) takes the gathered dispatch's
    buffers: P copies of each row and P * min(k, E_local) expert rows, whatever the routing."""
    from types import SimpleNamespace

    from megatron_grpo.megatron.moe.ep_dispatch import gathered_decode_width

    cfg = SimpleNamespace(num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                          ffn_hidden_size=6144, hidden_size=2048, expert_model_parallel_size=8)  # fmt: skip
    assert gathered_decode_width(cfg) == 3 * 8 * 2048 + 64 * (2 * 2048 + 3 * 768 + 2)
    cfg.num_moe_experts = 16  # two local experts: at most 2 rows of a token per rank
    assert gathered_decode_width(cfg) == 3 * 8 * 2048 + 16 * (2 * 2048 + 3 * 768 + 2)
    cfg.tensor_model_parallel_size = 2  # TP 2 inside EP 8: each TP rank brings half the rows
    full = 3 * 8 * 2048 + 16 * (2 * 2048 + 3 * 768 + 2)
    assert gathered_decode_width(cfg) == full // 2 + 2 * 2048
    cfg.expert_model_parallel_size = 1
    assert gathered_decode_width(cfg) == 0


def test_sort_permute_keeps_the_five_value_contract_of_megatron_core_0_19():
    """megatron-core 0.19's ``permute`` takes ``tokens_per_expert`` / ``align_size`` and returns
    five values: the sort path returns the same arity (no padding: None, the counts as given),
    and an alignment it does not do goes to megatron-core's."""
    from megatron_grpo.megatron.moe.alltoall_permute import make_sort_permute

    calls = []

    def permute_019(
        tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False,
        tokens_per_expert=None, align_size=0,
    ):  # fmt: skip
        calls.append(align_size)
        return tokens, probs, None, "pad", tokens_per_expert

    sort_permute = make_sort_permute(permute_019)
    t, e, k = 6, 4, 2
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1], [2, 0]])
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter_(1, ids, True)
    counts = routing_map.sum(0)
    x = torch.randn(t, 3)
    out = sort_permute(x, routing_map, num_out_tokens=t * k, tokens_per_expert=counts)
    assert len(out) == 5 and out[3] is None and out[4] is counts and not calls
    assert out[0].shape == (t * k, 3)
    sort_permute(x, routing_map, num_out_tokens=t * k, tokens_per_expert=counts, align_size=16)
    assert calls == [16]


def _permute_sorted(tokens, routing_map):
    return routing_map.reshape(-1).argsort(descending=True, stable=True)


def test_the_sort_permute_is_installed_once(monkeypatch):
    """The sort permute replaces megatron-core's permute (masked or sorted: both gather with an
    atomic backward), once: a second call keeps the installed one."""
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_grpo.megatron.moe.alltoall_permute import use_sort_permute

    monkeypatch.setattr(token_dispatcher, "permute", _permute_sorted)
    assert use_sort_permute() and token_dispatcher.permute.megatron_permute is _permute_sorted
    installed = token_dispatcher.permute
    assert not use_sort_permute() and token_dispatcher.permute is installed


def _built_choice_body(rank: int, world: int) -> None:
    from megatron_grpo.ops.kernels import LayerKernels

    cpu_alltoall()
    kernels = LayerKernels(moe_dispatch="alltoall", moe_sort="argsort")
    chunks = build_layout(EP2, _cfg(2, layer_kernels=kernels))
    mlp = unwrap(chunks[0]).decoder.layers[0].mlp
    assert mlp.ep_dispatch.choice == "alltoall"  # given when the model is built
    assert mlp.ep_dispatch.gathered.sort == "argsort"
    with no_host_sync(chunks):
        assert mlp.ep_dispatch.resolve() == "megatron"  # not even for decode steps


def test_moe_dispatch_is_chosen_when_the_model_is_built():
    """``model.layer_kernels.moe_dispatch`` reaches every expert-parallel layer through the
    spec; without grouped experts an explicit choice is an error, not a no-op."""
    from types import SimpleNamespace

    from megatron_grpo.megatron.model.layer_spec import portable_layer_spec
    from megatron_grpo.ops.kernels import LayerKernels

    run_distributed(_built_choice_body, 2)
    config = SimpleNamespace(num_moe_experts=8, moe_grouped_gemm=False)
    with pytest.raises(ValueError, match="moe_dispatch='gathered' needs grouped experts"):
        portable_layer_spec(config, True, LayerKernels(moe_dispatch="gathered"))
    with pytest.raises(ValueError, match="moe_sort='counting' needs grouped experts"):
        portable_layer_spec(config, True, LayerKernels(moe_sort="counting"))
    with pytest.raises(ValueError, match=r"moe_sort must be one of .*\(did you mean 'argsort'\?\)"):
        LayerKernels(moe_sort="argsrot")


def _sync_free_body(rank, world):
    from tests.host_syncs import HostSyncProbe

    cpu_alltoall()
    chunks = build_layout(ParallelConfig(expert_model_parallel_size=world), _cfg(2))
    model = unwrap(chunks[0]).eval()
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(6, 1, H, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad(), no_host_sync(model):
        assert mlp.ep_dispatch.resolve() == "gathered"
        probe = HostSyncProbe()
        with probe:
            mlp(x)
    assert not probe.calls, probe.calls
    switch_dispatch(chunks, "alltoall")  # the probe sees megatron-core's split-size sync
    with torch.no_grad(), HostSyncProbe() as probe:
        mlp(x)
    assert any("tolist" in c for c in probe.calls), probe.calls


def test_gathered_dispatch_decode_forward_makes_no_host_sync():
    """The MoE layer's decode forward through the gathered dispatch calls nothing that waits
    for the device (item, tolist, bool, nonzero, ...: what fails a CUDA graph capture); the
    all-to-all dispatcher, which copies its split sizes to the host, is seen doing it."""
    run_distributed(_sync_free_body, 2)


def _training_sync_body(rank, world):
    from tests.host_syncs import HostSyncProbe

    cpu_alltoall()
    chunks = build_layout(ParallelConfig(expert_model_parallel_size=world), _cfg(2))
    mlp = unwrap(chunks[0]).train().decoder.layers[0].mlp
    x = torch.randn(6, 1, H, generator=torch.Generator().manual_seed(rank))

    def fwd_bwd(choice: str) -> list[str]:
        switch_dispatch(chunks, choice)
        with HostSyncProbe() as probe:
            out, _ = mlp(x.clone().requires_grad_())
            out.sum().backward()
        return probe.calls

    assert not fwd_bwd("gathered")  # training passes too: nothing the host waits for
    assert any("tolist" in c for c in fwd_bwd("alltoall"))  # megatron-core's split sizes


def test_gathered_dispatch_trains_without_host_sync():
    """``model.layer_kernels.moe_dispatch: gathered`` takes the sync-free dispatch into the
    training passes (forward and backward), where megatron-core's all-to-all reads its split
    sizes on the host in every layer."""
    run_distributed(_training_sync_body, 2)
