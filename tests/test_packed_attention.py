"""Packed causal attention (length-bucketed SDPA) against a per-document float64 loop."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_grpo.megatron.attention import packed as pa


def _params(lens: list[int], padded: list[int] | None = None) -> PackedSeqParams:
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_pad = None
    if padded is not None:
        cu_pad = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=max(lens),
        max_seqlen_kv=max(lens),
    )


def _sdpa(q, k, v, mask=None):
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


def _reference(q, k, v, bounds: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One SDPA call per document, in float64 (leaves of its own); zeros after the last one.

    Returns the output and its float64 leaves (for ground-truth gradients)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = torch.zeros_like(q)
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e > s:
            x = [t[s:e].double().transpose(0, 1)[None] for t in (q, k, v)]
            out[s:e] = _sdpa(*x)[0].transpose(0, 1)
    return out, (q, k, v)


def _strided(q, k, v):
    """The same values as non-contiguous views of one [T, n, d] buffer (megatron's qkv split)."""
    qkv = torch.cat([q, k, v], dim=1)
    return torch.split(qkv, [q.size(1), k.size(1), v.size(1)], dim=1)


def _inputs(total: int, n_q: int = 4, n_kv: int = 2, d: int = 16, dtype=torch.float32, dev="cpu"):
    g = torch.Generator().manual_seed(total)
    return [
        torch.randn(total, n, d, generator=g).to(dev, dtype).requires_grad_()
        for n in (n_q, n_kv, n_kv)
    ]


@pytest.mark.parametrize(
    "lens, padded, total",
    [
        ([5, 1, 17, 3, 64, 9], None, 99),  # five length buckets
        ([7], None, 7),  # one document (no gather)
        ([8, 8, 8], None, 24),  # equal documents (no gather)
        ([6, 6], None, 14),  # equal documents, 2 tokens of padding
        ([0, 6, 6], None, 12),  # an empty document: the gathered path
        ([3, 0, 6], [4, 0, 8], 14),  # empty document, padded bounds (CP/TP style)
        ([10, 3], None, 16),  # 3 tokens of TP/SP padding after the last document
    ],
)
@pytest.mark.parametrize("buckets", pa.BUCKETS)
def test_bucketed_matches_per_document_reference(lens, padded, total, buckets):
    q, k, v = _inputs(total)
    params = _params(lens, padded)
    # q / k / v as megatron hands them over: strided views of one fused projection
    q, k, v = _strided(q, k, v)
    out = pa.packed_causal_attention(q, k, v, params, sdpa=_sdpa, buckets=buckets)
    bounds = (params.cu_seqlens_q_padded if padded else params.cu_seqlens_q).tolist()
    ref, leaves = _reference(q, k, v, bounds)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    assert torch.all(out[bounds[-1] :] == 0)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, leaves, grad.double())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-4)


def test_documents_never_attend_to_each_other():
    q, k, v = _inputs(12)
    params = _params([6, 6])
    out = pa.packed_causal_attention(q, k, v, params, sdpa=_sdpa)
    (g,) = torch.autograd.grad(out[6:].sum(), (k,))
    assert torch.all(g[:6] == 0) and g[6:].abs().sum() > 0


def test_layout_is_cached_and_rebuilt_when_bounds_change():
    params = _params([4, 4])
    first = pa.document_layout(params, torch.device("cpu"))
    assert pa.document_layout(params, torch.device("cpu")) is first
    params.cu_seqlens_q[1] = 2  # in-place edit: a new layout
    second = pa.document_layout(params, torch.device("cpu"))
    assert second is not first and sorted(s for _, s in second.buckets.shapes) == [2, 6]


@pytest.mark.parametrize("buckets", pa.BUCKETS)
def test_plan_free_buckets_run_without_cudnn_and_equal_documents_keep_torchs_choice(buckets):
    seen = []

    def spy(q, k, v, mask=None):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return _sdpa(q, k, v, mask)

    q, k, v = _inputs(40)
    pa.packed_causal_attention(q, k, v, _params([5, 17, 3, 15]), sdpa=spy, buckets=buckets)
    assert seen and all(enabled == (buckets != "plan_free") for enabled in seen)
    seen.clear()  # equal documents: one reshape, one call on torch's own choice
    pa.packed_causal_attention(q, k, v, _params([10] * 4), sdpa=spy, buckets=buckets)
    assert seen == [True]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the call


def test_unknown_buckets_is_an_error_naming_the_choices():
    q, k, v = _inputs(8)
    with pytest.raises(ValueError, match="plan_free"):
        pa.packed_causal_attention(q, k, v, _params([3, 5]), sdpa=_sdpa, buckets="round")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_spec_sdpa_with_gqa_on_every_bucket_way_on_gpu(dtype):
    """The spec's own call (GQA without copies in 16 bits) under each way of running buckets:
    the same answer as the per-document float64 loop, within the dtype's error."""
    from functools import partial

    from megatron_grpo.megatron.attention.sdpa import sdpa

    lens = [5, 1, 300, 3, 1024, 77, 640]
    q, k, v = _inputs(sum(lens), n_q=8, n_kv=2, d=128, dtype=dtype, dev="cuda")
    params = _params(lens)
    ref, _ = _reference(q, k, v, params.cu_seqlens_q.tolist())
    call = partial(sdpa, causal=True, scale=128**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for buckets in pa.BUCKETS:
        out = pa.packed_causal_attention(q, k, v, params, sdpa=call, buckets=buckets)
        assert (out.double() - ref).abs().max().item() < tol, buckets
        out.sum().backward()  # the backward runs on the forward's backend


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_gpu_within_per_document_sdpa_error():
    lens = [5, 1, 300, 3, 1024, 77]
    q, k, v = _inputs(sum(lens) + 6, n_q=8, n_kv=2, d=128, dtype=torch.bfloat16, dev="cuda")
    params = _params(lens)
    bounds = params.cu_seqlens_q.tolist()
    out = pa.packed_causal_attention(q, k, v, params, sdpa=_sdpa)
    ref, leaves = _reference(q, k, v, bounds)
    loop = torch.zeros_like(q)  # the same-dtype baseline: one bf16 SDPA call per document
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        loop[s:e] = _sdpa(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
    err, err_loop = ((x.double() - ref).abs().max().item() for x in (out, loop))
    assert err <= 2 * err_loop + 1e-3, (err, err_loop)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    base = torch.autograd.grad(loop, (q, k, v), grad)
    want = torch.autograd.grad(ref, leaves, grad.double())
    for a, b, w in zip(got, base, want, strict=True):
        err, err_loop = (a.double() - w).abs().max().item(), (b.double() - w).abs().max().item()
        assert err <= 2 * err_loop + 1e-2, (err, err_loop)


def _cp_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    from megatron_grpo.megatron.attention.cp import cp_causal_attention
    from megatron_grpo.megatron.batch.packing import thd_partition_index
    from megatron_grpo.megatron.parallel import redirect_cuda_device_to_cpu

    redirect_cuda_device_to_cpu()  # as initialize_parallel does: megatron's gather asks for it

    padded = [4 * world, 8 * world, 4 * world, 2 * world]  # two of one length: batched
    total = sum(padded)
    q, k, v = _inputs(total, n_q=4, n_kv=2, d=8)
    params = _params(padded)  # Megatron's CP params carry the global (padded) bounds
    ref, leaves = _reference(q, k, v, params.cu_seqlens_q.tolist())
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    want = torch.autograd.grad(ref, leaves, grad.double())
    index = thd_partition_index(params.cu_seqlens_q, world, rank)
    local = [x.detach()[index].requires_grad_() for x in (q, k, v)]

    def gqa_sdpa(q, k, v, mask):  # the native GQA path, as SDPAttention uses on torch >= 2.5
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    for sdpa in (gqa_sdpa, _sdpa):
        out = cp_causal_attention(*local, params, dist.group.WORLD, sdpa=sdpa)
        torch.testing.assert_close(out.double(), ref[index], atol=2e-6, rtol=2e-5)
        got = torch.autograd.grad(out, local, grad[index])
        for a, w in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), w[index].double(), atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_matches_the_full_sequence(world):
    """Each CP rank's output and q/k/v gradients (K/V all-gathered, their gradients
    reduce-scattered) equal the unsplit per-document attention at its tokens."""
    from tests.dist_utils import run_distributed

    run_distributed(_cp_body, world)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_host_sync_after_the_first_layer():
    """The layout (and the RoPE positions) are built once per micro-batch: later layers'
    attention and RoPE forwards run without a device-to-host sync."""
    from megatron_grpo.megatron.attention.rope import PackedRope

    lens = [5, 17, 3, 9, 33, 2]  # several length buckets
    params = _params(lens)
    params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.cuda()
    q, k, v = _inputs(sum(lens), dtype=torch.bfloat16, dev="cuda")
    freqs = torch.rand(max(lens), 1, 1, 16, device="cuda")
    rope = PackedRope(freqs, freqs, 1.0, False, "auto", 1, 0)
    for layer in range(2):
        if layer:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                qr, kr = rope.apply(q, k, params)
                pa.packed_causal_attention(qr, kr, v, params, sdpa=_sdpa)
        finally:
            torch.cuda.set_sync_debug_mode("default")
