"""SwiGLU of the training passes: the kernels (forward and backward) against float64 ground
truth within the same-dtype torch reference's error plus a few units of roundoff, and the
portable spec's ``SwiGLUMLP`` equal to megatron-core's own ``MLP.forward`` bit for bit on CPU.

As in test_kernels.py the interpreter tests run in a fresh process with TRITON_INTERPRET=1; GPU
tests (marked gpu) run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.mlp import MLP

from megatron_grpo.megatron import ParallelConfig
from megatron_grpo.megatron.model.layers import SwiGLUMLP
from megatron_grpo.ops.kernels import LayerKernels
from megatron_grpo.ops.layers.swiglu import swiglu, swiglu_scaled_torch, swiglu_torch
from tests.dist_utils import run_distributed
from tests.megatron_utils import build_layout, tiny_model


def test_interpreter_subprocess():
    """Run this module's interpreter tests in a fresh process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from tests.interpreter import run_interpreter_tests

    run_interpreter_tests(__file__)


def _run(fn, x, grad):
    x = x.detach().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _err(got, truth) -> float:
    return ((got.double() - truth).abs() / (1 + truth.abs())).max().item()


def _check(dtype, device, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(device, dtype)
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(device, dtype)
    truth = _run(swiglu_torch, x.double(), grad.double())
    ref = _run(swiglu_torch, x, grad)
    got = _run(lambda v: swiglu(v, impl="triton"), x, grad)
    with torch.no_grad():  # the no-graph path (no autograd.Function) computes the same
        assert torch.equal(swiglu(x, impl="triton"), got[0])
    tol = 2 * torch.finfo(dtype).eps
    for name, k, r, t in zip(("y", "dx"), got, ref, truth, strict=True):
        assert k.dtype == r.dtype and k.shape == r.shape, name
        assert _err(k, t) <= _err(r, t) + tol, (name, _err(k, t), _err(r, t))


SHAPES = pytest.mark.parametrize("shape", [(7, 2 * 50), (5, 1, 2 * 1100), (3, 2, 2 * 8)])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


@SHAPES
@DTYPES
def test_kernels_interpreter_match_float64(shape, dtype):
    from tests.interpreter import IN_INTERPRETER

    if not IN_INTERPRETER:
        pytest.skip("runs under TRITON_INTERPRET=1 in test_interpreter_subprocess")
    _check(dtype, "cpu", shape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@SHAPES
@DTYPES
def test_kernels_gpu_match_float64(shape, dtype):
    _check(dtype, "cuda", shape)


def _run_scaled(fn, x, probs, grad):
    x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
    y = fn(x, probs)
    y.backward(grad)
    return y.detach(), x.grad, probs.grad


def _check_scaled(dtype, device, rows, f):
    """The routed experts' SwiGLU scaled by fp32 row probabilities: y, dx and dprobs."""
    g = torch.Generator().manual_seed(f)
    x = (torch.randn(rows, 2 * f, generator=g) * 4).to(device, dtype)
    probs = torch.rand(rows, generator=g).to(device)
    grad = torch.randn(rows, f, generator=g).to(device, dtype)
    truth = _run_scaled(swiglu_scaled_torch, x.double(), probs.double(), grad.double())
    ref = _run_scaled(swiglu_scaled_torch, x, probs, grad)
    got = _run_scaled(lambda v, p: swiglu(v, impl="triton", probs=p), x, probs, grad)
    with torch.no_grad():
        assert torch.equal(swiglu(x, impl="triton", probs=probs), got[0])
    tol = 2 * torch.finfo(dtype).eps
    for name, k, r, t in zip(("y", "dx", "dprobs"), got, ref, truth, strict=True):
        assert k.dtype == r.dtype and k.shape == r.shape, name
        # dprobs sums F products: its roundoff grows with F (fp32 sums in both)
        extra = 1e-6 * f if name == "dprobs" else 0.0
        assert _err(k, t) <= _err(r, t) + tol + extra, (name, _err(k, t), _err(r, t))


SCALED = pytest.mark.parametrize("rows, f", [(7, 50), (3, 1100), (1, 8)])


@SCALED
@DTYPES
def test_scaled_kernels_interpreter_match_float64(rows, f, dtype):
    from tests.interpreter import IN_INTERPRETER

    if not IN_INTERPRETER:
        pytest.skip("runs under TRITON_INTERPRET=1 in test_interpreter_subprocess")
    _check_scaled(dtype, "cpu", rows, f)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@SCALED
@DTYPES
def test_scaled_kernels_gpu_match_float64(rows, f, dtype):
    _check_scaled(dtype, "cuda", rows, f)


def test_scaled_torch_path_is_megatron_expert_activation():
    """impl="torch" with probs is megatron-core's expert MLP activation, bit for bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g).bfloat16()
    p = torch.rand(6, generator=g)
    want = (swiglu_torch(x) * p.unsqueeze(-1)).to(torch.bfloat16)
    assert torch.equal(swiglu(x, impl="torch", probs=p), want)
    with pytest.raises(ValueError, match="probs"):
        swiglu(x, impl="torch", probs=p[:3])


def _mlp_body(rank: int, world: int) -> None:
    kernels = LayerKernels(elementwise="torch")
    cfg = tiny_model(add_qkv_bias=False, add_bias_linear=False, layer_kernels=kernels)
    chunks = build_layout(ParallelConfig(), cfg)
    mlps = [m for m in chunks[0].modules() if isinstance(m, SwiGLUMLP)]
    assert mlps and all(m.fused_swiglu and m.impl == "torch" for m in mlps)
    mlp = mlps[0]
    x = torch.randn(9, 1, mlp.config.hidden_size, generator=torch.Generator().manual_seed(0))
    grad = torch.randn_like(x)
    outs = []
    weight = mlp.linear_fc1.weight  # Megatron's DDP accumulates into main_grad
    for forward in (mlp.forward, lambda v: MLP.forward(mlp, v)):
        weight.main_grad.zero_()
        v = x.clone().requires_grad_()
        out, bias = forward(v)
        assert bias is None
        out.backward(grad)
        outs.append((out.detach(), v.grad, weight.main_grad.clone()))
    assert outs[0][2].abs().sum() > 0
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_swiglu_mlp_equals_megatron_mlp():
    run_distributed(_mlp_body, 1)


def _decode_support_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import unwrap
    from megatron_grpo.rollout.fused_decode import unsupported

    for bias in (False, True):
        chunks = build_layout(ParallelConfig(), tiny_model(add_bias_linear=bias))
        assert unsupported(unwrap(chunks[0]), tp_size=1) == "", (
            "the fused decode step refuses the spec"
        )


def test_fused_decode_step_accepts_the_portable_spec():
    """The portable spec's own subclasses (SwiGLUMLP, PackedRopeSelfAttention) keep the
    generation engine's fused decode step (it checks the layer types)."""
    run_distributed(_decode_support_body, 1)
