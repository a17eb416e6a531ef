"""SwiGLU of an fc1 output in one pass: ``[b, 2F] -> [b, F]``, and its gradient.

``y = x (+ bias)`` (rounded to the model dtype), ``gate, up = y[:, :F], y[:, F:]`` (megatron-core's
``chunk(2, -1)``), ``out = silu(gate) * up`` with ``silu(gate)`` and the product each rounded to
the model dtype, as megatron-core's unfused path computes them. Programs tile (row, F block).
The reference is ``megatron_grpo.ops.layers.decode.swiglu_torch``; ``swiglu_bwd`` is its
gradient for the training passes (``megatron_grpo.ops.layers.swiglu``).
"""

from __future__ import annotations

import functools

import torch

from ._rounding import round_to
from ._runtime import check_device, interpret_mode, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the launcher raises a clear error on use
    triton = None
    tl = None

BLOCK = 1024


def _swiglu_kernel(x_ptr, bias_ptr, out_ptr, F, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * F + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * F + F + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        gate = round_to(gate + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32), dtype)
        up = round_to(up + tl.load(bias_ptr + F + cols, mask=ok, other=0.0).to(tl.float32), dtype)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * F + cols, round_to(act * up, dtype).to(dtype), mask=ok)


@functools.cache
def _build(interpret: bool):
    """The kernel for one run mode; ``interpret`` keys the cache only."""
    require_triton()
    return triton.jit(_swiglu_kernel)


def swiglu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``x [b, 2F]`` contiguous (``bias [2F]`` added first) -> ``[b, F]``."""
    require_triton()
    check_device("x", x)
    if x.dim() != 2 or x.size(1) % 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [b, 2F] tensor, got {list(x.shape)}")
    b, f = x.size(0), x.size(1) // 2
    if bias is not None and bias.shape != (2 * f,):
        raise ValueError(f"bias must be [2F]=[{2 * f}], got {list(bias.shape)}")
    out = torch.empty(b, f, dtype=x.dtype, device=x.device)
    if b and f:
        grid = (b, triton.cdiv(f, BLOCK))
        _build(interpret_mode())[grid](
            x, bias, out, f, HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4
        )
    return out


def _swiglu_bwd_kernel(x_ptr, g_ptr, dx_ptr, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    dtype = dx_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * F + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * F + F + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * F + cols, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)  # the forward's rounded silu(gate)
    d_up = round_to(g * act, dtype)
    d_act = round_to(g * up, dtype)
    d_gate = round_to(d_act * sig * (1.0 + gate * (1.0 - sig)), dtype)  # torch's silu_backward
    tl.store(dx_ptr + row * 2 * F + cols, d_gate.to(dtype), mask=ok)
    tl.store(dx_ptr + row * 2 * F + F + cols, d_up.to(dtype), mask=ok)


@functools.cache
def _build_bwd(interpret: bool):
    require_triton()
    return triton.jit(_swiglu_bwd_kernel)


def swiglu_bwd(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`swiglu` (no bias) w.r.t. ``x [b, 2F]`` for ``grad [b, F]``, both
    contiguous: megatron-core's unfused graph (``silu(gate) * up``) with its roundings."""
    require_triton()
    check_device("x", x)
    b, f = x.size(0), x.size(1) // 2
    if x.dim() != 2 or x.size(1) % 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [b, 2F] tensor, got {list(x.shape)}")
    if grad.shape != (b, f) or not grad.is_contiguous() or grad.dtype != x.dtype:
        raise ValueError(f"grad must be contiguous [b, F]=[{b}, {f}] in {x.dtype}")
    dx = torch.empty_like(x)
    if b and f:
        grid = (b, triton.cdiv(f, BLOCK))
        _build_bwd(interpret_mode())[grid](x, grad, dx, f, BLOCK=BLOCK, num_warps=4)
    return dx


# ------------------------------------------------------------------ SwiGLU scaled per row
# The routed experts' activation (megatron-core's expert MLP with ``per_token_scale``):
# ``h = silu(gate) * up`` rounded as above, then ``(h * p).to(dtype)`` with ``p`` the row's fp32
# routing probability (the product in fp32, rounded once). One program holds a whole row, so the
# backward's ``d p = sum_j g_j h_j`` (fp32) needs no atomics.


def _swiglu_scaled_kernel(x_ptr, p_ptr, out_ptr, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < F
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * F + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * F + F + cols, mask=ok, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + row).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    h = round_to(act * up, dtype)
    tl.store(out_ptr + row * F + cols, round_to(h * p, dtype).to(dtype), mask=ok)


def _swiglu_scaled_bwd_kernel(x_ptr, p_ptr, g_ptr, dx_ptr, dp_ptr, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < F
    dtype = dx_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * F + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * F + F + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * F + cols, mask=ok, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + row).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    h = round_to(act * up, dtype)  # the forward's unscaled product
    tl.store(dp_ptr + row, tl.sum(tl.where(ok, g * h, 0.0), axis=0))
    gh = round_to(g * p, dtype)  # d h, in the model dtype
    d_up = round_to(gh * act, dtype)
    d_act = round_to(gh * up, dtype)
    d_gate = round_to(d_act * sig * (1.0 + gate * (1.0 - sig)), dtype)
    tl.store(dx_ptr + row * 2 * F + cols, d_gate.to(dtype), mask=ok)
    tl.store(dx_ptr + row * 2 * F + F + cols, d_up.to(dtype), mask=ok)


@functools.cache
def _build_scaled(interpret: bool, backward: bool):
    require_triton()
    return triton.jit(_swiglu_scaled_bwd_kernel if backward else _swiglu_scaled_kernel)


MAX_SCALED_F = 16384  # one program per row holds its F columns


def _check_scaled(x: torch.Tensor, probs: torch.Tensor) -> tuple[int, int]:
    check_device("x", x)
    if x.dim() != 2 or x.size(1) % 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [b, 2F] tensor, got {list(x.shape)}")
    b, f = x.size(0), x.size(1) // 2
    if probs.shape != (b,) or probs.dtype != torch.float32 or not probs.is_contiguous():
        raise ValueError(f"probs must be a contiguous float32 [b]=[{b}], got {list(probs.shape)}")
    if f > MAX_SCALED_F:
        raise ValueError(f"swiglu_scaled holds a row per program: F={f} > {MAX_SCALED_F}")
    return b, f


def swiglu_scaled(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``(silu(gate) * up) * probs[:, None]`` of ``x [b, 2F]`` with megatron-core's roundings
    (the product rounded, then scaled in fp32 and rounded) -> ``[b, F]``."""
    require_triton()
    b, f = _check_scaled(x, probs)
    out = torch.empty(b, f, dtype=x.dtype, device=x.device)
    if b and f:
        block = triton.next_power_of_2(f)
        _build_scaled(interpret_mode(), False)[(b,)](x, probs, out, f, BLOCK=block, num_warps=4)
    return out


def swiglu_scaled_bwd(
    x: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`swiglu_scaled` for ``grad [b, F]``: ``(dx [b, 2F], dprobs [b] fp32)``
    as autograd computes megatron-core's unfused graph."""
    require_triton()
    b, f = _check_scaled(x, probs)
    if grad.shape != (b, f) or not grad.is_contiguous() or grad.dtype != x.dtype:
        raise ValueError(f"grad must be contiguous [b, F]=[{b}, {f}] in {x.dtype}")
    dx = torch.empty_like(x)
    dp = torch.empty(b, dtype=torch.float32, device=x.device)
    if b and f:
        block = triton.next_power_of_2(f)
        _build_scaled(interpret_mode(), True)[(b,)](
            x, probs, grad, dx, dp, f, BLOCK=block, num_warps=4
        )
    return dx, dp
