"""Grouped MoE experts (``GroupedExperts``, ``ops.layers.grouped_mm``) against megatron-core's
``SequentialMLP`` on the same weights: the op, the experts module (zero-token experts, uneven
loads, fp32 and bf16), whole models (top-k 1/2/8, router gradients), op counts that must not grow
with the number of experts, checkpoints in both directions, and EP 2 / TP 2 + SP + EP 2."""

from __future__ import annotations

import tempfile

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep, ParallelConfig, unwrap
from megatron_grpo.megatron.moe.grouped_experts import GroupedExperts
from megatron_grpo.ops.kernels import LayerKernels
from megatron_grpo.ops.layers.grouped_mm import grouped_mm, resolve_grouped_mm
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
from tests.op_count import CountOps

COUNTS = [0, 13, 1, 0, 3, 0, 2, 1]  # zero-token experts and one heavy expert (E = 8)


def _loop64(x, w, counts):
    """float64 ground truth: one matmul per group."""
    parts = torch.split(x.double(), counts)
    return torch.cat([p @ w[g].double().T for g, p in enumerate(parts)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["auto", "padded_bmm"])
@pytest.mark.parametrize("k", [16, 12])  # K=12 bf16 (24 bytes) is not aligned: the padded path
def test_grouped_mm_matches_float64_loop(dtype, impl, k):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), k, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(COUNTS), 24, k, generator=g).to(dtype).requires_grad_()
    ends = torch.tensor(COUNTS).cumsum(0)
    y = grouped_mm(x, w, ends, impl=impl)
    gy = torch.randn(y.shape, generator=g).to(dtype)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    want = _loop64(x, w, COUNTS)
    same_dtype = _loop64(x, w, COUNTS).to(dtype)  # a same-dtype reference's rounding
    ref_err = (same_dtype.double() - want).abs().max().item()
    tol = 1e-6 if dtype == torch.float32 else 2 * ref_err + 1e-2
    assert (y.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    gx64, gw64 = torch.autograd.grad(_loop64(x64, w64, COUNTS), (x64, w64), gy.double())
    assert (gx.double() - gx64).abs().max().item() <= tol * max(1.0, gx64.abs().max().item())
    assert (gw.double() - gw64).abs().max().item() <= tol * max(1.0, gw64.abs().max().item())
    assert gw[0].abs().max() == 0 and gw[3].abs().max() == 0  # experts without tokens


def test_grouped_mm_decision_is_explicit():
    x, w = torch.zeros(4, 6), torch.zeros(2, 8, 6)
    assert resolve_grouped_mm("auto", x, w) == "padded_bmm"  # rows of 24 bytes: not aligned
    assert resolve_grouped_mm("auto", x[:, :4], w[..., :4]) == "grouped_mm"  # 16 bytes
    assert resolve_grouped_mm("padded_bmm", torch.zeros(4, 16), torch.zeros(2, 8, 16)) == (
        "padded_bmm"
    )
    with pytest.raises(ValueError, match="grouped_mm"):
        resolve_grouped_mm("grouped_mm", torch.zeros(4, 6), torch.zeros(2, 8, 6))
    with pytest.raises(ValueError, match="one of"):
        resolve_grouped_mm("loop", x, w)
    with pytest.raises(ValueError, match="ends must be"):
        grouped_mm(x, w, torch.tensor([4]))
    empty = grouped_mm(torch.zeros(0, 16), w.new_zeros(2, 8, 16), torch.zeros(2))
    assert empty.shape == (0, 8)


def _moe_cfg(topk: int = 2, experts: int = 8, grouped: bool = True, **kw):
    kw.setdefault("moe_router_pre_softmax", topk == 1)  # megatron-core requires it at top-1
    return tiny_model(
        num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=32,
        moe_grouped_gemm=grouped, **kw,
    )  # fmt: skip


def _experts(chunks) -> torch.nn.Module:
    return unwrap(chunks[0]).decoder.layers[0].mlp.experts


def _pair(parallel: ParallelConfig, topk: int = 2, experts: int = 8, **kw):
    """(SequentialMLP model, GroupedExperts model) with the same weights."""
    seq = build_layout(parallel, _moe_cfg(topk, experts, grouped=False, **kw))
    weights = full_params(seq)
    grp = build_layout(parallel, _moe_cfg(topk, experts, grouped=True, **kw))
    # the same seed initializes the same model (experts in SequentialMLP's order and RNG)
    for name, value in full_params(grp).items():
        assert torch.equal(value, weights[name]), f"{name} initialized differently"
    load_full(grp, weights, _moe_cfg(topk, experts, **kw))
    assert isinstance(_experts(grp), GroupedExperts)
    assert type(_experts(seq)).__name__ == "SequentialMLP"
    # one rank holds every expert: the sort-based local dispatch (no host sync)
    local = parallel.expert_model_parallel_size == parallel.tensor_model_parallel_size == 1
    assert unwrap(grp[0]).decoder.layers[0].mlp.local_dispatch == local
    return seq, grp, weights


def _module_run(experts, x, probs, dtype):
    experts = experts.to(dtype)
    xi = x.to(dtype).requires_grad_()
    pi = probs.clone().requires_grad_()
    out, bias = experts(xi, torch.tensor(COUNTS), pi)
    assert bias is None
    grads = torch.autograd.grad(out, [xi, pi, *experts.parameters()], torch.ones_like(out))
    w_grads = grads[2:]
    if isinstance(experts, GroupedExperts):
        w_grads = [g[e] for e in range(len(COUNTS)) for g in w_grads]  # per expert: fc1, fc2
    return [out, grads[0], grads[1], *w_grads]


def _check_module(seq, grp) -> None:
    """Experts module alone, fp32 (1e-6 relative) and bf16 (within a bf16 reference's error
    of the float64 result), forward and every backward, on zero-token and uneven loads."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(COUNTS), 64, generator=g)
    probs = torch.rand(sum(COUNTS), generator=g)
    want64 = _module_run(seq, x, probs, torch.float64)
    for dtype, rel in ((torch.float32, 1e-6), (torch.bfloat16, None)):
        ref = _module_run(seq, x, probs, dtype)
        got = _module_run(grp, x, probs, dtype)
        for i, (a, b, w) in enumerate(zip(got, ref, want64, strict=True)):
            scale = max(1.0, w.abs().max().item())
            err = (a.double() - w).abs().max().item()
            bound = rel * scale if rel else (b.double() - w).abs().max().item() * 2 + 1e-2 * scale
            assert err <= bound, f"{dtype} output/grad {i}: {err:.3e} > {bound:.3e}"
    seq.float(), grp.float()


def _check_models(seq, grp, batches) -> None:
    """Whole-model log-probs and every gradient (router included) equal in fp32."""
    step = GRPOStep(GRPOLossConfig(), vocab_size=100)
    for a, b in zip(step.compute_logprobs(grp, batches), step.compute_logprobs(seq, batches),
                    strict=True):  # fmt: skip
        assert_close("logprobs", a, b, tol=1e-6)
    train_grads(seq, step, batches)
    train_grads(grp, step, batches)
    cfg = _moe_cfg()
    want, got = gather_full_grads(seq, cfg), gather_full_grads(grp, cfg)
    assert any("router" in n for n in want)
    for name, g in got.items():
        assert_close(f"grad {name}", g, want[name], tol=1e-6)


def _layer_ops(experts: int, grouped: bool) -> int:
    """aten ops of one MoE layer's forward + backward (router, dispatch, experts)."""
    chunks = build_layout(ParallelConfig(), _moe_cfg(2, experts, grouped=grouped))
    mlp = unwrap(chunks[0]).decoder.layers[0].mlp
    x = torch.randn(24, 1, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with CountOps() as mode:
        out, _ = mlp(x)
        out.sum().backward()
    return mode.count


def _check_checkpoints(seq, grp) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_grpo.convert.mcore_io import checkpoint_io

    def layout(chunks):
        sd = unwrap(chunks[0]).sharded_state_dict()
        apply_factories(sd)
        flat = [t for v in sd.values() for t in (v if isinstance(v, list) else [v])]
        return sorted(
            (t.key, t.global_shape, t.global_offset, t.axis_fragmentations, str(t.replica_id))
            for t in flat
            if isinstance(t, ShardedTensor) and ".experts." in t.key
        )

    assert layout(seq) == layout(grp) and layout(grp)
    for src, dst in ((seq, grp), (grp, seq)):
        with tempfile.TemporaryDirectory() as d, checkpoint_io():
            dist_checkpointing.save(unwrap(src[0]).sharded_state_dict(), d)
            with torch.no_grad():
                for p in unwrap(dst[0]).parameters():
                    p.zero_()
            loaded = dist_checkpointing.load(unwrap(dst[0]).sharded_state_dict(), d)
            unwrap(dst[0]).load_state_dict(loaded)
        a, b = full_params(src), full_params(dst)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # a plain state dict of SequentialMLP (local_experts.<e>.linear_fc<n>.weight) loads too
    with torch.no_grad():
        for p in unwrap(grp[0]).parameters():
            p.zero_()
    unwrap(grp[0]).load_state_dict(unwrap(seq[0]).state_dict(), strict=True)
    assert all(torch.equal(full_params(grp)[n], t) for n, t in full_params(seq).items())


def _body_single(rank: int, world: int) -> None:
    seqs = make_sequences(6, seed=3)
    batches = [pack(seqs[:3]), pack(seqs[3:])]
    for topk in (1, 2, 8):
        seq, grp, _ = _pair(ParallelConfig(), topk)
        if topk == 2:
            _check_module(_experts(seq), _experts(grp))
            _check_checkpoints(seq, grp)
        _check_models(seq, grp, batches)
    # the decode step of the grouped model never syncs with the host (CUDA graphs can take it)
    from megatron_grpo.megatron.moe.local_dispatch import host_sync_reason

    assert host_sync_reason(unwrap(grp[0])) is None
    assert "SequentialMLP experts" in host_sync_reason(unwrap(seq[0]))
    assert unwrap(grp[0]).decoder.layers[0].mlp.token_dispatcher.sort == "auto"
    # the padded-bmm grouped GEMM, chosen explicitly: the same model, a host sync per layer
    kernels = LayerKernels(grouped_gemm="padded_bmm", elementwise="torch", moe_sort="argsort")
    padded = build_layout(ParallelConfig(), _moe_cfg(topk, layer_kernels=kernels))
    load_full(padded, full_params(seq), _moe_cfg(topk))
    assert (_experts(padded).gemm_impl, _experts(padded).impl) == ("padded_bmm", "torch")
    assert unwrap(padded[0]).decoder.layers[0].mlp.token_dispatcher.sort == "argsort"
    assert "padded_bmm" in host_sync_reason(unwrap(padded[0]))
    _check_models(seq, padded, batches)
    with pytest.raises(ValueError, match="grouped_gemm must be one of"):
        LayerKernels(grouped_gemm="loop")
    # no per-expert loop: the op count of a layer's forward + backward does not grow with E
    grouped = [_layer_ops(e, grouped=True) for e in (4, 16)]
    looped = [_layer_ops(e, grouped=False) for e in (4, 16)]
    assert grouped[0] == grouped[1], grouped
    assert looped[1] > looped[0] + 12 * 3, looped  # the loop the count test catches


@pytest.mark.slow
def test_grouped_experts_equal_sequential_mlp():
    run_distributed(_body_single, 1)


def _body_parallel(rank: int, world: int, parallel: ParallelConfig) -> None:
    seqs = make_sequences(4, seed=5)
    batches = [pack(seqs[:2], multiple=2), pack(seqs[2:], multiple=2)]
    cfg = _moe_cfg(2)
    step = GRPOStep(GRPOLossConfig(), vocab_size=cfg.vocab_size)
    ref = build_layout(ParallelConfig(), _moe_cfg(2, grouped=False))  # EP 1, the loop
    weights = full_params(ref)
    ref_logp = step.compute_logprobs(ref, batches)
    train_grads(ref, step, batches)
    ref_grads = gather_full_grads(ref, cfg)
    chunks = build_layout(parallel, cfg)
    load_full(chunks, weights, cfg)
    assert isinstance(_experts(chunks), GroupedExperts)
    assert not unwrap(chunks[0]).decoder.layers[0].mlp.local_dispatch  # megatron-core's
    from megatron_grpo.megatron.moe.local_dispatch import host_sync_reason

    why = host_sync_reason(unwrap(chunks[0]))  # decode: the gathered dispatch at expert-TP 1
    if (parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size) == 1:
        assert why is None, why
    else:
        assert "token dispatcher (expert_tensor_parallel_size=2)" in why, why
    assert _experts(chunks).weight1.shape[0] == 8 // parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size
    assert _experts(chunks).weight2.shape[2] == 32 // etp  # the FFN split over expert-TP
    for got, want in zip(step.compute_logprobs(chunks, batches), ref_logp, strict=True):
        assert_close("logprobs", got, want, tol=1e-5)
    train_grads(chunks, step, batches)
    for name, g in gather_full_grads(chunks, cfg).items():
        assert_close(f"grad {name}", g, ref_grads[name], tol=5e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(expert_model_parallel_size=2),
        ParallelConfig(
            tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        ),
        # expert tensor parallelism: every expert's FFN split over the 2 TP ranks (ETP = TP)
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    ],
    ids=["ep2", "tp2_sp_ep2", "tp2_sp_etp2"],
)  # fmt: skip
def test_grouped_experts_expert_parallel(parallel):
    run_distributed(_body_parallel, 2, parallel)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[0, 1, 3, 0, 17, 250, 2, 0], [0] * 7 + [40], [64] * 8])
def test_gpu_grouped_mm_matches_loop(counts):
    """torch's grouped GEMM on CUDA bf16 (uneven, empty and unaligned group sizes): forward and
    both gradients within a bf16 per-expert loop's error of the float64 result."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(counts), 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(8, 384, 256, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
    ends = torch.tensor(counts, device="cuda").cumsum(0)
    assert resolve_grouped_mm("auto", x, w) == "grouped_mm"
    y = grouped_mm(x, w, ends)
    gy = torch.randn(y.shape, device="cuda", generator=g).bfloat16()
    got = [y, *torch.autograd.grad(y, (x, w), gy)]
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = _loop64(x64, w64, counts)
    want = [y64, *torch.autograd.grad(y64, (x64, w64), gy.double())]
    xb, wb = x.detach().requires_grad_(), w.detach().requires_grad_()
    yb = torch.cat([p @ wb[i].T for i, p in enumerate(torch.split(xb, counts))])
    loop = [yb, *torch.autograd.grad(yb, (xb, wb), gy)]
    for name, a, b, c in zip(("y", "dx", "dw"), got, loop, want, strict=True):
        err, ref = (a.double() - c).abs().max().item(), (b.double() - c).abs().max().item()
        assert err <= 2 * ref + 1e-3 * c.abs().max().item(), f"{name}: {err:.3e} vs loop {ref:.3e}"


def _gpu_body(rank: int, world: int) -> None:
    """bf16 models on one GPU: GroupedExperts (torch's grouped GEMM) against SequentialMLP."""
    seqs = make_sequences(6, seed=3)
    batches = [pack(seqs[:3]), pack(seqs[3:])]
    kw = dict(params_dtype="bfloat16")
    seq, grp, _ = _pair(ParallelConfig(), 8, 8, **kw)
    assert _experts(grp).weight1.is_cuda
    step = GRPOStep(GRPOLossConfig(), vocab_size=100)
    a = torch.cat(step.compute_logprobs(grp, batches))
    b = torch.cat(step.compute_logprobs(seq, batches))
    assert (a - b).abs().max().item() < 0.1, (a - b).abs().max().item()  # bf16 roundings
    train_grads(seq, step, batches)
    train_grads(grp, step, batches)
    want, got = gather_full_grads(seq, _moe_cfg()), gather_full_grads(grp, _moe_cfg())
    for name, g in got.items():
        scale = want[name].abs().max().item() + 1e-6
        assert (g - want[name]).abs().max().item() <= 0.05 * scale, name


@pytest.mark.gpu
def test_gpu_grouped_experts_equal_sequential_bf16():
    run_distributed(_gpu_body, 1, backend="nccl")


@pytest.mark.parametrize("ranks, experts", [(1, 8), (2, 4), (4, 3)])
def test_chunk_sort_equals_megatron_split_cat(ranks, experts):
    """The dispatcher's chunk order by local expert (and back) as one gather equals
    megatron-core's split + cat, zero-size chunks included; the identity order copies nothing."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from megatron_grpo.megatron.moe.permute import sort_chunks_by_index

    g = torch.Generator().manual_seed(ranks)
    sizes = torch.randint(0, 4, (ranks * experts,), generator=g)
    chunks = torch.arange(ranks * experts)
    by_expert = chunks.reshape(-1, experts).T.ravel()  # the dispatcher's two orders
    back = chunks.reshape(experts, -1).T.ravel()
    x = torch.randn(int(sizes.sum()), 5, generator=g, requires_grad=True)
    probs = torch.rand(x.shape[0], generator=g, requires_grad=True)
    got, got_p = sort_chunks_by_index(x, sizes, by_expert, probs=probs)
    want, want_p = sort_chunks_by_idxs(x, sizes, by_expert, probs=probs)
    assert torch.equal(got, want) and torch.equal(got_p, want_p)
    # the backward (a gather by the inverse permutation) equals the split + cat's
    dy, dp = torch.randn(got.shape, generator=g), torch.randn(got_p.shape, generator=g)
    if x.shape[0]:
        mine = torch.autograd.grad((got, got_p), (x, probs), (dy, dp), retain_graph=True)
        theirs = torch.autograd.grad((want, want_p), (x, probs), (dy, dp))
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    back_sizes = sizes.reshape(-1, experts).T.ravel()
    restored, _ = sort_chunks_by_index(got, back_sizes, back)
    assert torch.equal(restored, x)
    (gx,) = torch.autograd.grad(restored, x, torch.ones_like(x))
    assert torch.equal(gx, torch.ones_like(x))
    if ranks == 1:
        assert sort_chunks_by_index(x, sizes, by_expert)[0] is x
    with pytest.raises(ValueError, match="fused"):
        sort_chunks_by_index(x, sizes, by_expert, fused=True)


def test_sort_routing_matches_megatron_permute_and_unpermute():
    """The local dispatch's rows and probs equal megatron-core's mask-based permute; its
    combine equals the scatter-add unpermute (fp32); gradients flow to every token row."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from megatron_grpo.megatron.moe.permute import combine_tokens, permute_tokens, sort_by_expert

    g = torch.Generator().manual_seed(0)
    t, e, k, h = 11, 6, 3, 4
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.rand(t, e, generator=g) * routing_map
    x = torch.randn(t, h, generator=g, requires_grad=True)
    want, want_p, sorted_idx = permute(x, routing_map, probs=probs)
    order, inverse, counts = sort_by_expert(ids, e)
    got = permute_tokens(x, order, inverse, k)
    got_p = probs.gather(1, ids).reshape(-1)[order]
    assert torch.equal(got, want) and torch.equal(got_p, want_p)
    assert torch.equal(counts, routing_map.sum(0))
    y = torch.randn(t * k, h, generator=g, requires_grad=True)
    combined = combine_tokens(y, order, inverse, k)
    assert torch.allclose(combined, unpermute(y, sorted_idx, x.shape), atol=1e-6)
    (gx,) = torch.autograd.grad(got, x, torch.ones_like(got))
    assert torch.equal(gx, torch.full_like(x, float(k)))
    (gy,) = torch.autograd.grad(combined, y, torch.ones_like(combined))
    assert torch.equal(gy, torch.ones_like(y))


def _gpu_graphs_body(rank: int, world: int) -> None:
    """The engine captures the MoE model's decode steps in CUDA graphs (local dispatch, grouped
    GEMMs: no host sync) and samples what eager decode samples."""
    from tests.ep_utils import check_graphs_match_eager

    chunks = build_layout(ParallelConfig(), _moe_cfg(2, params_dtype="bfloat16"))
    model = unwrap(chunks[0])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 100, (int(n),), generator=g).tolist() for n in range(3, 23)]
    check_graphs_match_eager(model, prompts)  # "CUDA graphs on"


@pytest.mark.gpu
def test_gpu_moe_decode_runs_in_cuda_graphs():
    run_distributed(_gpu_graphs_body, 1, backend="nccl")
