"""Rotary position embedding of ``[T, n, d]`` heads with per-token ``cos`` / ``sin`` rows.

megatron-core's unfused formula, ``y = x * cos + rotate_half(x) * sin`` on the first ``ROT``
features (the rest pass through), with both products and the sum each rounded to the model
dtype as torch computes them, so forward and backward equal megatron-core's autograd graph bit
for bit in bf16, fp16 and fp32 (fp32 is compiled without FMA contraction for that reason).

``rotate_half`` maps feature ``i`` to ``sign(i) * x[p(i)]`` with the partner ``p(i) = i ^ 1``
(interleaved) or ``(i + ROT / 2) mod ROT``, and ``sign(i) = -1`` for the even / first-half
features. ``p`` is an involution, so the backward is the same kernel with the partner's sine:
``dx[j] = g[j] * cos[j] - sign(j) * g[p(j)] * sin[p(j)]``. Programs tile (token block, head).
The reference is ``megatron_grpo.ops.layers.rope.apply_rotary_torch``.
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

BLOCK_T = 16


def _partner_of(cols, ROT: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``(p(i), first(i))``: the rotation partner of each feature and whether it is negated
    (the first half's / even features'). Shared with ``kernels.qk_norm_rope``."""
    if INTERLEAVED:
        partner = cols ^ 1
        first = (cols % 2) == 0
    else:
        partner = tl.where(cols < ROT // 2, cols + ROT // 2, cols - ROT // 2)
        first = cols < ROT // 2
    return partner, first


# a Triton function (kernels call it): a plain Python helper runs in the interpreter only
rotation_partner = triton.jit(_partner_of) if triton is not None else None


def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, T, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
    ROT: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    rows64 = rows.to(tl.int64)[:, None]
    ok_row = (rows < T)[:, None]
    rot = (cols < ROT)[None, :]
    partner, first = rotation_partner(cols, ROT, INTERLEAVED)
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + rows64 * stride_xt + head * stride_xh
    x = tl.load(x_row + cols[None, :], mask=ok_row & (cols < D)[None, :], other=0.0)
    x = x.to(tl.float32)
    xp = tl.load(x_row + partner[None, :], mask=ok_row & rot, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + rows64 * stride_c + cols[None, :], mask=ok_row & rot, other=0.0)
    if BACKWARD:  # the partner's sine, and the sign of the partner's feature
        s = tl.load(sin_ptr + rows64 * stride_c + partner[None, :], mask=ok_row & rot, other=0.0)
        sign = tl.where(first, 1.0, -1.0)[None, :]
    else:
        s = tl.load(sin_ptr + rows64 * stride_c + cols[None, :], mask=ok_row & rot, other=0.0)
        sign = tl.where(first, -1.0, 1.0)[None, :]
    a = round_to(x * c.to(tl.float32), dtype)
    b = round_to(xp * s.to(tl.float32), dtype) * sign
    y = tl.where(rot, round_to(a + b, dtype), x)
    out_row = out_ptr + rows64 * stride_ot + head * stride_oh
    tl.store(out_row + cols[None, :], y.to(dtype), mask=ok_row & (cols < D)[None, :])


@functools.cache
def _build(interpret: bool):
    """The kernel for one run mode; ``interpret`` keys the cache only."""
    require_triton()
    return triton.jit(_rope_kernel)


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool,
    backward: bool = False,
) -> torch.Tensor:  # fmt: skip
    """RoPE of ``x [T, n, d]`` (last dim contiguous) with ``cos, sin [T, ROT]`` (contiguous, in
    ``x``'s dtype, ``ROT`` even and ``<= d``) -> a new contiguous ``[T, n, d]``.

    ``backward``: the gradient w.r.t. the input of the forward, ``x`` being the output's
    gradient."""
    require_triton()
    check_device("x", x)
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, n, d] with a contiguous last dim, got {list(x.shape)}")
    t, n, d = x.shape
    rot = cos.size(-1)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (t, rot) or not table.is_contiguous() or table.dtype != x.dtype:
            raise ValueError(
                f"{name} must be contiguous [T={t}, ROT] in {x.dtype}, got "
                f"{list(table.shape)} {table.dtype}"
            )
    if rot % 2 or rot > d:
        raise ValueError(f"the rotary dim ROT={rot} must be even and <= the head dim {d}")
    out = torch.empty(t, n, d, dtype=x.dtype, device=x.device)
    if t and n and d:
        grid = (triton.cdiv(t, BLOCK_T), n)
        extra = {} if interpret_mode() else {"enable_fp_fusion": False}
        _build(interpret_mode())[grid](
            x, cos, sin, out, t, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            cos.stride(0), ROT=rot, D=d, BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(d),
            INTERLEAVED=interleaved, BACKWARD=backward, num_warps=4, **extra,
        )  # fmt: skip
    return out
