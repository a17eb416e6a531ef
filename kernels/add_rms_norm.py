"""Residual add + RMSNorm of one decode step's rows in one pass: ``[b, H]`` in, two ``[b, H]`` out.

``t = x (+ bias)``, ``res = residual + t`` (each sum rounded to the model dtype, as megatron-core's
bias-dropout-add does in that dtype), then ``y = rms_norm(res) * weight`` in fp32, rounded to
the model dtype once (megatron_grpo's ``Norm``). One program owns one row; H fits one block.
The reference is ``megatron_grpo.ops.layers.decode.add_rms_norm_torch``.
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


def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    bias_ptr,
    w_ptr,
    res_out_ptr,
    y_ptr,
    H,
    eps,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    dtype = y_ptr.dtype.element_ty
    t = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        t = round_to(t + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32), dtype)
    if HAS_RES:
        t = round_to(
            t + tl.load(res_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32), dtype
        )
        tl.store(res_out_ptr + row * H + cols, t.to(dtype), mask=ok)
    rstd = 1.0 / tl.sqrt(tl.sum(t * t, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, round_to(t * rstd * w, dtype).to(dtype), mask=ok)


@functools.cache
def _build(interpret: bool):
    """The kernel for one run mode; ``interpret`` keys the cache only."""
    require_triton()
    return triton.jit(_add_rms_norm_kernel)


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(res, y)``: ``res = residual + (x + bias)`` (``x (+ bias)`` without a residual) and
    ``y = rms_norm(res) * weight``; ``x``, ``residual`` ``[b, H]`` contiguous, ``weight``,
    ``bias`` ``[H]``. ``res`` is written into ``residual`` in place (each row reads its own row
    first), so a decode step keeps one residual buffer."""
    require_triton()
    check_device("x", x)
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [b, H] tensor, got {list(x.shape)}")
    b, h = x.shape
    if weight.shape != (h,) or (bias is not None and bias.shape != (h,)):
        raise ValueError(f"weight and bias must be [H]=[{h}]")
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous {list(x.shape)} tensor")
    if residual is None and bias is not None:
        raise ValueError("a bias needs a residual (the bias-dropout-add it belongs to)")
    y = torch.empty_like(x)
    res = residual if residual is not None else x
    if b:
        _build(interpret_mode())[(b,)](
            x, res, bias, weight, res, y, h, float(eps),
            HAS_RES=residual is not None, HAS_BIAS=bias is not None,
            BLOCK=triton.next_power_of_2(h), num_warps=4 if h <= 4096 else 8,
        )  # fmt: skip
    return res, y
