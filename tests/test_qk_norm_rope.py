"""The fused q / k RMSNorm + RoPE op (``ops.layers.qk_norm_rope``) against float64 truth and in
the model.

* The kernels (interpreted on CPU, compiled on GPU) are within the same-dtype torch reference's
  error of the float64 truth plus a few units of roundoff, forward and backward (inputs and both
  weights), at odd head dims, partial and interleaved rotary, k a strided view of the QKV output.
* In the model, the fused path equals the separate norms + RoPE: bit for bit on the torch
  reference (fp32; test_packed_rope_model compares it with megatron-core's path at TP 2 + SP
  and CP 2), within rounding on the interpreted kernels.
* The decision (``attention.rope.fuses_qk_norm``) and the errors of an explicit "fused" that
  cannot apply.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_grpo.megatron.attention.rope import fuses_qk_norm
from megatron_grpo.ops.layers.qk_norm_rope import qk_norm_rope, qk_norm_rope_torch

EPS = 1e-6


def test_interpreter_subprocess():
    """Run this module's interpreter tests in a fresh process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from tests.interpreter import run_interpreter_tests

    run_interpreter_tests(__file__)


def _inputs(t, nq, nk, d, rot, dtype, device, seed=0):
    """Megatron's QKV layout: per KV group, its q heads, its k head, its v head; q and k are
    strided views of it (as ``get_query_key_value_tensors`` splits them)."""
    g = torch.Generator().manual_seed(seed)
    per = nq // nk
    qkv = (torch.randn(t, nk, (per + 2) * d, generator=g) * 3 + 0.5).to(device, dtype)
    wq = (torch.rand(d, generator=g) + 0.5).to(device, dtype)
    wk = (torch.rand(d, generator=g) + 0.5).to(device, dtype)
    angle = torch.rand(t, rot, generator=g) * 6.3
    cos, sin = torch.cos(angle).to(device, dtype), torch.sin(angle).to(device, dtype)
    grads = (
        torch.randn(t, nq, d, generator=g).to(device, dtype),
        torch.randn(t, nk, d, generator=g).to(device, dtype),
    )
    return qkv, wq, wk, cos, sin, grads


def _split(qkv, nq: int, nk: int, d: int):
    """``(q [T, NQ, D], k [T, NK, D])`` of ``qkv``, the views megatron's QKV split makes."""
    per = nq // nk
    q = qkv[:, :, : per * d].reshape(qkv.size(0), nq, d)
    return q, qkv[:, :, per * d : (per + 1) * d]


def _run(fn, qkv, wq, wk, cos, sin, grads, nq, nk):
    """``fn``'s outputs and the gradients of ``qkv`` and both weights."""
    qkv, wq, wk = (x.detach().requires_grad_() for x in (qkv, wq, wk))
    qo, ko = fn(*_split(qkv, nq, nk, wq.numel()), wq, wk, cos, sin)
    torch.autograd.backward((qo, ko), grads)
    return qo.detach(), ko.detach(), qkv.grad, wq.grad, wk.grad


def _err(got: torch.Tensor, truth: torch.Tensor) -> float:
    return ((got.double() - truth).abs() / (1 + truth.abs())).max().item()


def _check(dtype, device, t, nq, nk, d, rot, interleaved):
    qkv, wq, wk, cos, sin, grads = _inputs(t, nq, nk, d, rot, dtype, device)

    def ref(q, k, a, b, c, s):
        return qk_norm_rope_torch(q, k, a, b, EPS, c, s, interleaved)

    def kernel(q, k, a, b, c, s):
        return qk_norm_rope(q, k, a, b, EPS, c, s, interleaved=interleaved, impl="triton")

    args = (qkv, wq, wk, cos, sin, grads)
    truth = _run(ref, *(x.double() for x in args[:5]), tuple(g.double() for g in grads), nq, nk)
    want = _run(ref, *args, nq, nk)
    got = _run(kernel, *args, nq, nk)
    tol = 4 * torch.finfo(dtype).eps
    names = ("q_out", "k_out", "d_qkv", "d_q_weight", "d_k_weight")
    for name, a, r, tr in zip(names, got, want, truth, strict=True):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        # a weight's gradient sums over every row of its heads: the error grows with them
        scale = {"d_q_weight": t * nq, "d_k_weight": t * nk}.get(name, 1)
        assert _err(a, tr) <= _err(r, tr) + tol * scale, (name, _err(a, tr), _err(r, tr))
    with torch.no_grad():  # the no-graph path (no autograd.Function) computes the same
        nograd = kernel(*_split(qkv, nq, nk, d), wq, wk, cos, sin)
        assert torch.equal(nograd[0], got[0]) and torch.equal(nograd[1], got[1])


CASES = pytest.mark.parametrize(
    "t,nq,nk,d,rot,interleaved",
    [
        (21, 4, 2, 16, 16, False),
        (13, 6, 3, 24, 24, True),  # a head dim that is not a power of two
        (9, 2, 2, 32, 16, False),  # partial rotary: features 16-31 pass through the norm only
        (17, 4, 1, 16, 8, True),
    ],
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


@CASES
@DTYPES
def test_kernels_interpreter_match_float64(t, nq, nk, d, rot, interleaved, dtype):
    from tests.interpreter import IN_INTERPRETER

    if not IN_INTERPRETER:
        pytest.skip("runs under TRITON_INTERPRET=1 in test_interpreter_subprocess")
    _check(dtype, "cpu", t, nq, nk, d, rot, interleaved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "t,nq,nk,d,rot,interleaved",
    [(4099, 16, 8, 128, 128, False), (1000, 8, 2, 96, 48, True), (333, 4, 4, 64, 64, False)],
)
@DTYPES
def test_kernels_gpu_match_float64(t, nq, nk, d, rot, interleaved, dtype):
    """One GPU."""
    _check(dtype, "cuda", t, nq, nk, d, rot, interleaved)


def test_empty_and_bad_inputs():
    q, k = torch.randn(0, 4, 16), torch.randn(0, 2, 16)
    w = torch.ones(16)
    out = qk_norm_rope(q, k, w, w, EPS, torch.zeros(0, 16), torch.zeros(0, 16), impl="torch")
    assert out[0].shape == (0, 4, 16) and out[1].shape == (0, 2, 16)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    table = torch.zeros(5, 16)
    with pytest.raises(ValueError, match=r"k \[T, NK, D\]; got q \[5, 4, 16\], k \[5, 2, 8\]"):
        qk_norm_rope(q, torch.randn(5, 2, 8), w, w, EPS, table, table, impl="torch")
    with pytest.raises(ValueError, match=r"q_weight and k_weight must be \[D=16\]"):
        qk_norm_rope(q, k, w, torch.ones(8), EPS, table, table, impl="torch")
    with pytest.raises(ValueError, match=r"cos, sin must be \[T=5, ROT\]"):
        qk_norm_rope(q, k, w, w, EPS, table[:4], table, impl="torch")


def test_the_decision():
    triton_here = pytest.importorskip("triton") is not None
    assert fuses_qk_norm("fused", "torch", "torch", "cpu")  # as asked
    assert not fuses_qk_norm("separate", "triton", "triton", "cuda")
    assert not fuses_qk_norm("auto", "auto", "auto", "cpu")  # the reference: nothing to save
    assert fuses_qk_norm("auto", "auto", "auto", "cuda") == triton_here
    assert not fuses_qk_norm("auto", "auto", "torch", "cuda")  # the norms on torch's path
    with pytest.raises(ValueError, match="qk_norm_rope must be one of .*did you mean 'fused'"):
        fuses_qk_norm("fusd", "auto", "auto", "cuda")


def _model_body(rank: int, world: int, impl: str) -> None:
    """The tiny model's log-probs and gradients with the fused op equal the separate ops'; an
    explicit "fused" without q / k norms is a build error."""
    from megatron_grpo.loss import GRPOLossConfig
    from megatron_grpo.megatron import GRPOStep, ParallelConfig
    from megatron_grpo.megatron.attention.rope import PackedRopeSelfAttention
    from megatron_grpo.ops.kernels import LayerKernels
    from tests.megatron_utils import (
        build_layout,
        gather_full_grads,
        make_sequences,
        pack,
        tiny_model,
        train_grads,
    )

    fused = LayerKernels(qk_norm_rope="fused")
    with pytest.raises(ValueError, match="qk_norm_rope='fused' cannot apply: the q / k norms"):
        build_layout(ParallelConfig(), tiny_model(qk_layernorm=False, layer_kernels=fused))
    model_cfg = tiny_model()
    step = GRPOStep(GRPOLossConfig(), vocab_size=model_cfg.vocab_size)
    seqs = make_sequences(7)
    batches = [pack(seqs[:4], 1), pack(seqs[4:], 1)]
    results = {}
    for choice in ("separate", "fused"):  # one seed: the same weights
        kernels = LayerKernels(elementwise=impl, rope=impl, qk_norm_rope=choice)
        chunks = build_layout(
            ParallelConfig(), dataclasses.replace(model_cfg, layer_kernels=kernels)
        )
        attn = [m for m in chunks[0].modules() if isinstance(m, PackedRopeSelfAttention)]
        calls = []
        for m in attn:  # the fused path must be the one that ran
            m.q_layernorm.register_forward_hook(lambda mod, a, out, c=calls: c.append(out is a[0]))
        logp = step.compute_logprobs(chunks, batches)
        train_grads(chunks, step, batches)
        assert calls and all(c == (choice == "fused") for c in calls), (choice, calls)
        results[choice] = (logp, gather_full_grads(chunks, model_cfg))
    (la, ga), (lb, gb) = results["fused"], results["separate"]
    exact = impl == "torch"
    for i, (a, b) in enumerate(zip(la, lb, strict=True)):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-5), f"logp[{i}]"
    for name, g in gb.items():
        a = ga[name]
        ok = torch.equal(a, g) if exact else torch.allclose(a, g, atol=1e-5, rtol=1e-4)
        assert ok, f"{impl} grad {name}: {(a - g).abs().max()}"


def test_model_fused_equals_separate_reference():
    from tests.dist_utils import run_distributed

    run_distributed(_model_body, 1, "torch")


def test_model_fused_equals_separate_interpreter():
    from tests.dist_utils import run_distributed
    from tests.interpreter import IN_INTERPRETER

    if not IN_INTERPRETER:
        pytest.skip("runs under TRITON_INTERPRET=1 in test_interpreter_subprocess")
    run_distributed(_model_body, 1, "triton")
