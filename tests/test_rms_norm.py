"""The RMSNorm kernels (forward and backward) against float64 ground truth: within the fp32
torch reference's error (``ops.layers.rms_norm.rms_norm_torch``) plus a few units of roundoff, at odd
widths, strided rows (megatron's k heads are a view of the QKV output), bf16 and fp32.

As in test_kernels.py the interpreter tests run in a fresh process with TRITON_INTERPRET=1; GPU
tests (marked gpu) run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.ops.layers.rms_norm import rms_norm, rms_norm_torch

EPS = 1e-6


def test_interpreter_subprocess():
    """Run this module's interpreter tests in a fresh process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from tests.interpreter import run_interpreter_tests

    run_interpreter_tests(__file__)


def _inputs(shape, n, dtype, device, strided: bool):
    g = torch.Generator().manual_seed(n + len(shape))
    full = list(shape[:-1]) + [3 * n if strided else n]
    base = (torch.randn(full, generator=g) * 3 + 0.5).to(device, dtype)
    x = base[..., n : 2 * n] if strided else base  # rows with a stride of 3n
    w = (torch.rand(n, generator=g) + 0.5).to(device, dtype)
    grad = torch.randn(shape, generator=g).to(device, dtype)
    return x, w, grad


def _run(fn, x, w, grad):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


def _err(got: torch.Tensor, truth: torch.Tensor) -> float:
    return ((got.double() - truth).abs() / (1 + truth.abs())).max().item()


def _check(dtype, device, shape, strided):
    n = shape[-1]
    x, w, grad = _inputs(shape, n, dtype, device, strided)
    truth = _run(lambda a, b: rms_norm_torch(a, b, EPS), x.double(), w.double(), grad.double())
    ref = _run(lambda a, b: rms_norm_torch(a, b, EPS), x, w, grad)
    got = _run(lambda a, b: rms_norm(a, b, EPS, impl="triton"), x, w, grad)
    with torch.no_grad():  # the no-graph path (no autograd.Function) computes the same
        assert torch.equal(rms_norm(x, w, EPS, impl="triton"), got[0])
    tol = 4 * torch.finfo(dtype).eps
    for name, k, r, t in zip(("y", "dx", "dw"), got, ref, truth, strict=True):
        assert k.dtype == r.dtype and k.shape == r.shape, name
        # dw sums over all rows: its error grows with the row count in both implementations
        scale = 1 if name != "dw" else x.numel() // n
        assert _err(k, t) <= _err(r, t) + tol * scale, (name, _err(k, t), _err(r, t))


CASES = pytest.mark.parametrize(
    "shape,strided",
    [((37, 48), False), ((5, 3, 100), True), ((64, 1, 256), False), ((9, 4, 128), True)],
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


@CASES
@DTYPES
def test_kernels_interpreter_match_float64(shape, strided, dtype):
    from tests.interpreter import IN_INTERPRETER

    if not IN_INTERPRETER:
        pytest.skip("runs under TRITON_INTERPRET=1 in test_interpreter_subprocess")
    _check(dtype, "cpu", shape, strided)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@CASES
@DTYPES
def test_kernels_gpu_match_float64(shape, strided, dtype):
    _check(dtype, "cuda", shape, strided)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_gpu_many_rows_bf16():
    _check(torch.bfloat16, "cuda", (8192, 8, 128), True)  # the q/k-norm shape of a micro-batch


def test_torch_impl_is_the_reference():
    x, w, _ = _inputs((6, 40), 40, torch.bfloat16, "cpu", False)
    assert torch.equal(rms_norm(x, w, EPS, impl="torch"), rms_norm_torch(x, w, EPS))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:-1], EPS)
