"""Packed attention whose kernel count does not grow with the distinct document lengths
(issue 42): the blocked path and the varlen_attn wrapper against a per-document float64 loop
and the length-bucketed path, the choice of path, the op counts, and the model's log-probs and
gradients on the blocked path against the length-bucketed one."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.megatron.attention import blocked as bl
from megatron_grpo.megatron.attention import choice
from megatron_grpo.megatron.attention import packed as pa
from megatron_grpo.megatron.attention import varlen as va
from megatron_grpo.megatron.attention.rope import PackedRope
from tests.op_count import CountOps
from tests.test_packed_attention import _inputs, _params, _reference, _sdpa, _strided

LAYOUTS = [
    ([5, 1, 17, 3, 64, 9], None, 99),  # odd lengths, 3 tokens of padding
    ([7], None, 7),  # one document
    ([1] * 13, None, 13),  # many one-token documents
    ([1] * 9 + [2], None, 12),  # one-token documents and padding
    ([0, 6, 6], None, 12),  # an empty document
    ([3, 0, 6], [4, 0, 8], 14),  # padded bounds (CP/TP style)
    ([33, 31, 2, 1, 30], None, 97),  # several windows, documents across block edges
    ([6, 6], None, 14),  # equal documents (no mask), 2 tokens of padding
]


def _bounds(params) -> list[int]:
    cu = params.cu_seqlens_q_padded
    return (params.cu_seqlens_q if cu is None else cu).tolist()


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("lens, padded, total", LAYOUTS)
def test_blocked_matches_float64_reference_in_fp32(lens, padded, total):
    q, k, v = _strided(*_inputs(total))
    params = _params(lens, padded)
    out = bl.blocked_causal_attention(q, k, v, params, sdpa=_sdpa)
    ref, leaves = _reference(q, k, v, _bounds(params))
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    assert torch.all(out[_bounds(params)[-1] :] == 0)
    grad = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), grad), _grads(ref, leaves, grad.double()), strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("lens, padded, total", LAYOUTS[:4])
def test_blocked_bf16_within_the_bucketed_paths_error(lens, padded, total):
    """bf16: the blocked path is no further from float64 truth than the length-bucketed path
    (outputs and gradients), and equals it within bf16's rounding."""
    q, k, v = _strided(*_inputs(total, dtype=torch.bfloat16))
    params = _params(lens, padded)
    out = bl.blocked_causal_attention(q, k, v, params, sdpa=_sdpa)
    base = pa.packed_causal_attention(q, k, v, params, sdpa=_sdpa)
    ref, leaves = _reference(q, k, v, _bounds(params))
    err, err_base = ((x.double() - ref).abs().max().item() for x in (out, base))
    assert err <= 2 * err_base + 4e-3, (err, err_base)
    torch.testing.assert_close(out, base, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    want = _grads(ref, leaves, grad.double())
    got, got_base = _grads(out, (q, k, v), grad), _grads(base, (q, k, v), grad)
    for a, b, w in zip(got, got_base, want, strict=True):
        err, err_base = (a.double() - w).abs().max().item(), (b.double() - w).abs().max().item()
        assert err <= 2 * err_base + 2e-2, (err, err_base)


def test_blocked_documents_never_attend_to_each_other():
    q, k, v = _inputs(40)
    params = _params([6, 17, 17])
    out = bl.blocked_causal_attention(q, k, v, params, sdpa=_sdpa)
    (g,) = torch.autograd.grad(out[6:23].sum(), (k,))
    assert torch.all(g[:6] == 0) and torch.all(g[23:] == 0) and g[6:23].abs().sum() > 0


def test_block_sizes():
    assert bl._block_sizes(1, 13) == (1, 16, 0)  # one-token documents: the diagonal
    assert bl._block_sizes(64, 99) == (2, 64, 64)  # the previous block is in the window
    assert bl._block_sizes(33, 97) == (2, 64, 64)
    assert bl._block_sizes(7, 7) == (1, 16, 0)  # one block: no window before it


# ---------------------------------------------------------------------------------------------
# op counts: the same for 2 and for many distinct lengths (same tokens, same longest document)


def _fwd_bwd_ops(fn, lens: list[int], total: int, **kwargs) -> int:
    params = _params(lens)
    q, k, v = _strided(*_inputs(total))
    fn(q, k, v, params, **kwargs)  # the layout: built once per micro-batch, outside the count
    with CountOps() as mode:
        out = fn(q, k, v, params, **kwargs)
        out.backward(torch.ones_like(out))
    return mode.count


FEW = [32, 1] * 4  # 2 distinct lengths, 132 tokens
MANY = [32, 1, 2, 3, 5, 8, 13, 17, 20, 31]  # 10 distinct lengths, 132 tokens


def test_blocked_op_count_does_not_grow_with_distinct_lengths():
    assert sum(FEW) == sum(MANY) and max(FEW) == max(MANY)
    few = _fwd_bwd_ops(bl.blocked_causal_attention, FEW, 132, sdpa=_sdpa)
    many = _fwd_bwd_ops(bl.blocked_causal_attention, MANY, 132, sdpa=_sdpa)
    assert few == many, (few, many)
    # the length-bucketed path on the same layouts grows (the count above can fail)
    few_b = _fwd_bwd_ops(pa.packed_causal_attention, FEW, 132, sdpa=_sdpa)
    many_b = _fwd_bwd_ops(pa.packed_causal_attention, MANY, 132, sdpa=_sdpa)
    assert many_b > few_b


def test_packed_rope_op_count_does_not_grow_with_distinct_lengths():
    freqs = torch.rand(32, 1, 1, 8)
    counts = []
    for lens in (FEW, MANY):
        params = _params(lens)
        q, k, _ = _inputs(132)
        rope = PackedRope(freqs, freqs, 1.0, False, "torch", 1, 0)
        rope.apply(q, k, params)  # the tables: once per micro-batch
        with CountOps() as mode:
            qr, kr = rope.apply(q, k, params)
            (qr.sum() + kr.sum()).backward()
        counts.append(mode.count)
    assert counts[0] == counts[1], counts


def _fake_varlen(calls: list):
    """A per-document stand-in for varlen_attn (CPU), recording its keywords."""

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((cu_q.tolist(), max_q, kwargs))
        assert cu_q is cu_k
        assert q.size(1) == k.size(1) or kwargs.get("enable_gqa")
        scale = kwargs.get("scale")
        out, bounds = torch.zeros_like(q), cu_q.tolist()
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            x = [t[s:e].transpose(0, 1)[None] for t in (q, k, v)]
            groups = q.size(1) // k.size(1)
            x[1], x[2] = (t.repeat_interleave(groups, dim=1) for t in x[1:])
            a = torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True, scale=scale)
            out[s:e] = a[0].transpose(0, 1)
        return out

    return fn


@pytest.mark.parametrize(
    "names", [("window_size", "scale", "enable_gqa"), ("window_size", "scale"), ("is_causal",)]
)
def test_varlen_wrapper_bounds_gqa_and_padding(monkeypatch, names):
    calls: list = []
    api = (_fake_varlen(calls), frozenset(names), None)
    monkeypatch.setattr(va, "_api", lambda: api)
    monkeypatch.setattr(va, "varlen_unavailable", lambda *a: None)
    lens, padded, total = [3, 0, 6], [4, 0, 8], 14
    q, k, v = _strided(*_inputs(total))
    params = _params(lens, padded)
    scale = 0.3
    out = va.varlen_causal_attention(q, k, v, params, scale=scale)
    ref, _ = _reference(q * (scale * 16**0.5), k, v, _bounds(params))
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    cu, longest, kwargs = calls[0]
    assert cu == [0, 4, 12, 14] and longest == 8  # empty document dropped, padding appended
    assert ("window_size" in kwargs) == ("window_size" in names)
    assert kwargs.get("enable_gqa", False) == ("enable_gqa" in names)
    assert torch.all(out[12:] == 0)
    va.varlen_causal_attention(q, k, v, params, scale=scale)
    assert va.varlen_layout(params, total, q.device) is va.varlen_layout(params, total, q.device)


def test_varlen_op_count_does_not_grow_with_distinct_lengths(monkeypatch):
    # one op for the kernel: only the wrapper's own ops are counted
    api = (lambda q, k, v, *a, **kw: q.clone(), frozenset({"window_size", "scale"}), None)
    monkeypatch.setattr(va, "_api", lambda: api)
    monkeypatch.setattr(va, "varlen_unavailable", lambda *a: None)
    few, many = (
        _fwd_bwd_ops(va.varlen_causal_attention, lens, 132, scale=0.25) for lens in (FEW, MANY)
    )
    assert few == many, (few, many)


# ---------------------------------------------------------------------------------------------
# the choice


def test_choice_on_cpu_and_errors():
    q, k, _ = _inputs(8)
    assert choice.choose_packed_impl("auto", q, k, 0.0) == (
        "blocked",
        va.varlen_unavailable(q, k, 0),
    )
    assert "CUDA only" in va.varlen_unavailable(q, k, 0.0) or "no torch.nn" in (
        va.varlen_unavailable(q, k, 0.0)
    )
    with pytest.raises(ValueError, match="'varlen' cannot run: .*choose 'blocked'"):
        choice.choose_packed_impl("varlen", q, k, 0.0)
    with pytest.raises(ValueError, match="must be one of"):
        choice.choose_packed_impl("flash", q, k, 0.0)
    with pytest.raises(ValueError, match="buckets must be one of"):
        choice.packed_attention(q, k, k, _params([8]), impl="auto", sdpa=_sdpa, scale=1.0,
                                buckets="round")  # fmt: skip
    for impl in ("blocked", "buckets"):
        assert choice.choose_packed_impl(impl, q, k, 0.5)[0] == impl
        assert choice.choose_packed_impl(impl, q, k, 0.0, _params([4, 4]))[0] == impl


def test_auto_runs_documents_of_one_length_as_one_sdpa_call():
    q, k, v = _inputs(10)
    for lens, want in (([5, 5], "buckets"), ([10], "buckets"), ([4, 6], "blocked")):
        assert choice.choose_packed_impl("auto", q, k, 0.0, _params(lens))[0] == want, lens
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return _sdpa(*args)

    out = choice.packed_attention(q, k, v, _params([5, 5]), impl="auto", sdpa=spy, scale=0.25)
    assert calls == [torch.Size([2, 4, 5, 16])]  # one causal call on [N, n, L, d]
    ref, _ = _reference(q, k, v, [0, 5, 10])
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)


def test_varlen_unavailable_reasons_on_gpu_like_inputs(monkeypatch):
    """The reasons an explicit 'varlen' names, with the device checks stubbed out."""
    q, k, _ = _inputs(8)
    assert "dropout" in _reasons(monkeypatch, q.bfloat16(), k.bfloat16(), 0.1)
    assert "float16 or bfloat16" in _reasons(monkeypatch, q, k, 0.0)
    assert "head dim" in _reasons(monkeypatch, q[..., :12].bfloat16(), k[..., :12].bfloat16(), 0)


def _reasons(monkeypatch, q, k, p) -> str:
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(va, "_api", lambda: (object(), frozenset(), None))
    try:
        return va.varlen_unavailable(q, k, p) or ""
    finally:
        monkeypatch.undo()


def test_layer_kernels_name_the_packed_attention_choices():
    from megatron_grpo.ops.kernels import LayerKernels

    assert choice.PACKED_IMPLS == ("auto", "varlen", "blocked", "buckets")
    with pytest.raises(ValueError, match="packed_attention must be one of .*'blocked'"):
        LayerKernels(packed_attention="block")


# ---------------------------------------------------------------------------------------------
# GPU


def _gpu_case(impl: str, dtype):
    from megatron_grpo.megatron.attention.sdpa import sdpa

    lens = [5, 1, 300, 3, 1024, 77, 640, 1, 1]
    q, k, v = _inputs(sum(lens) + 6, n_q=8, n_kv=2, d=128, dtype=dtype, dev="cuda")
    params = _params(lens)
    params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.cuda()

    def call(q, k, v, mask=None):  # SDPAttention._sdpa's call
        return sdpa(q, k, v, mask=mask, causal=mask is None, scale=128**-0.5)

    def run(path):
        return choice.packed_attention(q, k, v, params, impl=path, sdpa=call, scale=128**-0.5)

    out, base = run(impl), run("buckets")
    ref, leaves = _reference(q, k, v, params.cu_seqlens_q.tolist())
    err, err_base = ((x.double() - ref).abs().max().item() for x in (out, base))
    assert err <= 2 * err_base + 1e-3, (impl, err, err_base)
    grad = torch.randn_like(out)
    want = _grads(ref, leaves, grad.double())
    got, got_base = _grads(out, (q, k, v), grad), _grads(base, (q, k, v), grad)
    for a, b, w in zip(got, got_base, want, strict=True):
        err, err_base = (a.double() - w).abs().max().item(), (b.double() - w).abs().max().item()
        assert err <= 2 * err_base + 1e-2, (impl, err, err_base)
    torch.cuda.set_sync_debug_mode("error")  # later layers: no device-to-host sync
    try:
        with torch.no_grad():
            run(impl)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_attn_on_gpu_equals_reference(dtype):
    """1 GPU: varlen_attn (GQA, odd and one-token documents, padding) against the float64
    per-document loop, within the length-bucketed path's own error; no host sync after the
    first layer."""
    if va.varlen_unavailable(torch.empty(1, 8, 128, device="cuda", dtype=dtype),
                             torch.empty(1, 2, 128, device="cuda", dtype=dtype), 0.0):  # fmt: skip
        pytest.skip("varlen_attn cannot run here (torch < 2.10 or pre-Ampere)")
    _gpu_case("varlen", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocked_on_gpu_equals_reference(dtype):
    """1 GPU: the blocked path (memory-efficient SDPA with a mask) against the reference."""
    _gpu_case("blocked", dtype)


# ---------------------------------------------------------------------------------------------
# the model: a log-prob and a training pass dispatch the same ops for 2 or 10 distinct lengths


def _batch(lens: list[int]):
    from megatron_grpo.megatron import pack_sequences
    from tests.megatron_utils import VOCAB

    g = torch.Generator().manual_seed(len(set(lens)))
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    old = [-torch.rand(n, generator=g) for n in lens]
    adv = torch.randn(len(lens), generator=g)
    mask = [torch.arange(n) >= n // 2 for n in lens]
    return pack_sequences(seqs, mask, advantages=adv, old_logprobs=old)


def _model_ops(chunks, step, lens: list[int]) -> int:
    from tests.megatron_utils import train_grads

    batch = _batch(lens)
    with CountOps() as mode:
        step.compute_logprobs(chunks, [batch])
        train_grads(chunks, step, [batch])
    return mode.count


def _logprobs_and_grads(chunks, step, lens: list[int]):
    from tests.megatron_utils import train_grads

    batch = _batch(lens)
    logp = step.compute_logprobs(chunks, [batch])[0]
    train_grads(chunks, step, [batch])
    grads = {n: p.main_grad.clone() for n, p in chunks[0].named_parameters()}
    return logp, grads


def _model(impl: str):
    """The tiny model whose ``LayerKernels.packed_attention`` is ``impl`` (same seed: same
    weights)."""
    import dataclasses

    from megatron_grpo.megatron import ParallelConfig
    from megatron_grpo.megatron.attention.sdpa import SDPAttention
    from megatron_grpo.ops.kernels import LayerKernels
    from tests.megatron_utils import build_layout, tiny_model

    cfg = dataclasses.replace(tiny_model(), layer_kernels=LayerKernels(packed_attention=impl))
    chunks = build_layout(ParallelConfig(), cfg)
    cores = [m for m in chunks[0].modules() if isinstance(m, SDPAttention)]
    assert len(cores) == cfg.num_layers and all(m.packed == impl for m in cores)
    return chunks


def _model_body(rank: int, world: int) -> None:
    from megatron_grpo.loss import GRPOLossConfig
    from megatron_grpo.megatron import GRPOStep
    from tests.megatron_utils import tiny_model

    step = GRPOStep(GRPOLossConfig(), vocab_size=tiny_model().vocab_size)
    models = {impl: _model(impl) for impl in ("auto", "blocked", "buckets")}
    few, many = [16, 3] * 4, [16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15]  # 76 tokens, longest 16
    assert sum(few) == sum(many)
    counts = {}
    for impl, chunks in models.items():
        _model_ops(chunks, step, few)  # warm-up (first-call caches)
        counts[impl] = (_model_ops(chunks, step, few), _model_ops(chunks, step, many))
    assert counts["auto"][0] == counts["auto"][1], counts  # CPU: "auto" is "blocked"
    assert counts["blocked"][0] == counts["blocked"][1], counts
    assert counts["buckets"][1] > counts["buckets"][0], counts  # the count can fail
    # the log-probs and gradients of the blocked path equal the length-bucketed path's (fp32)
    want_logp, want = _logprobs_and_grads(models["buckets"], step, many + [5])
    logp, got = _logprobs_and_grads(models["blocked"], step, many + [5])
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    attn = [g for name, g in want.items() if "layers.0.self_attention" in name]
    assert attn and all(g.abs().sum() > 0 for g in attn)  # gradients that reach the attention
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_model_passes_op_count_does_not_grow_with_distinct_lengths():
    from tests.dist_utils import run_distributed

    run_distributed(_model_body, 1)


# ---------------------------------------------------------------------------------------------
# the bounds from their host copy: no device-to-host sync per micro-batch


def test_layouts_read_the_recorded_host_bounds():
    """Bounds on the meta device cannot be read back: the layout comes from the host copy the
    transport recorded, and from the device again once either copy changes."""
    host = _params([3, 5]).cu_seqlens_q
    params = _params([3, 5])
    params.cu_seqlens_q = params.cu_seqlens_kv = host.to("meta")
    pa.remember_host_bounds(params, {"cu_seqlens_q": host})
    assert pa.cached_layout(params, "_t", torch.device("cpu"), lambda b: b) == [0, 3, 8]
    host[1] = 4  # a changed host copy is not trusted
    with pytest.raises(NotImplementedError):
        pa.cached_layout(params, "_t2", torch.device("cpu"), lambda b: b)


def test_transport_records_host_bounds_through_the_rope_copy():
    from megatron_grpo.megatron import ParallelConfig
    from megatron_grpo.megatron.attention.rope import roped_params
    from megatron_grpo.megatron.batch.transport import _params_to
    from megatron_grpo.megatron.config import to_transformer_config
    from tests.megatron_utils import tiny_model

    params = _params_to(_params([3, 5], [4, 8]), torch.device("cpu"))
    assert pa._HOST in params.__dict__
    config = to_transformer_config(tiny_model(), ParallelConfig())
    roped = roped_params(params, torch.zeros(8, 1, 1, 4), config, "torch")
    assert roped.__dict__[pa._HOST] is params.__dict__[pa._HOST]
