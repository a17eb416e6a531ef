"""RMSNorm of ``[R, N]`` rows computed in fp32 and rounded once, forward and backward.

Forward: ``rstd = 1 / sqrt(mean(x^2) + eps)``, ``y = (x * rstd) * w`` in fp32, stored in the
output dtype, ``rstd`` kept (fp32 ``[R]``) for the backward. Backward, with ``xhat = x * rstd``
and ``gw = g * w``: ``dx = rstd * (gw - xhat * mean(gw * xhat))`` (rounded once to the input
dtype) and per-program fp32 partial sums of ``g * xhat`` for the weight gradient, summed by the
launcher. This is the torch reference's math (``F.rms_norm`` on fp32 copies, the casts around
it) without the fp32 copies of the input and gradient; only the mean's summation order differs.

Rows may be strided (``row_stride``, unit stride inside a row): megatron's k heads are a view of
the fused QKV output. Programs take tiles of ``ROWS`` rows; the backward is persistent (a grid of
at most a few programs per SM) so the weight gradient's partial sums stay small.
The reference is ``megatron_grpo.ops.layers.rms_norm.rms_norm_torch``.
"""

from __future__ import annotations

import functools

import torch

from ._runtime import check_device, interpret_mode, num_sms, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the launcher raises a clear error on use
    triton = None
    tl = None


def _fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, R, N, x_stride, eps,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    ok = (rows < R)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    y = (x * rstd[:, None]) * w[None, :]
    tl.store(y_ptr + r64 * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(rstd_ptr + rows, rstd, mask=rows < R)


def _bwd_kernel(
    g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, R, N, g_stride, x_stride, tiles,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile in range(pid, tiles, tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        ok = (rows < R)[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + r64 * g_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)
        xhat = x * rstd[:, None]
        gw = g * w[None, :]
        mean = tl.sum(gw * xhat, axis=1) / N
        dx = (gw - xhat * mean[:, None]) * rstd[:, None]
        tl.store(dx_ptr + r64 * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
        dw += tl.sum(g * xhat, axis=0)
    tl.store(dw_ptr + pid.to(tl.int64) * N + cols, dw, mask=col_ok)


@functools.cache
def _build(interpret: bool):
    """The kernels for one run mode; ``interpret`` keys the cache only."""
    require_triton()
    return triton.jit(_fwd_kernel), triton.jit(_bwd_kernel)


def _tiling(n: int) -> tuple[int, int, int]:
    """``(BLOCK_N, ROWS, num_warps)``: tiles of about 4096 elements."""
    block = triton.next_power_of_2(n)
    rows = max(1, min(32, 4096 // block))
    return block, rows, 8 if block * rows >= 4096 else 4


def _rows(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[R, N]`` rows with unit stride inside a row: a view when the strides allow."""
    check_device(name, t)
    if t.size(-1) != n:
        raise ValueError(f"{name} must end in the normalized size {n}, got {list(t.shape)}")
    try:
        rows = t.view(-1, n)
    except RuntimeError:
        rows = t.reshape(-1, n)
    return rows if rows.stride(-1) == 1 or rows.size(0) == 0 else rows.contiguous()


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., N]``, ``weight [N]`` -> ``(y, rstd)``: ``y`` contiguous in ``x``'s shape and
    dtype, ``rstd`` fp32 ``[R]`` (R = rows of ``x``)."""
    require_triton()
    n = weight.numel()
    rows = _rows("x", x, n)
    r = rows.size(0)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(r, dtype=torch.float32, device=x.device)
    if r:
        block, per, warps = _tiling(n)
        fwd, _ = _build(interpret_mode())
        fwd[(triton.cdiv(r, per),)](
            rows, weight, y, rstd, r, n, rows.stride(0), eps, ROWS=per, BLOCK_N=block,
            num_warps=warps,
        )  # fmt: skip
    return y, rstd


def rms_norm_bwd(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rms_norm_fwd`: ``(dx, dweight)``, ``dx`` contiguous in ``x``'s shape
    and dtype, ``dweight`` in ``weight``'s dtype (fp32-accumulated)."""
    require_triton()
    n = weight.numel()
    g_rows, x_rows = _rows("grad", grad, n), _rows("x", x, n)
    r = x_rows.size(0)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not r:
        return dx, torch.zeros_like(weight)
    block, per, warps = _tiling(n)
    tiles = triton.cdiv(r, per)
    programs = min(tiles, 4 * num_sms(x.device))
    partial = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    _, bwd = _build(interpret_mode())
    bwd[(programs,)](
        g_rows, x_rows, weight, rstd, dx, partial, r, n, g_rows.stride(0), x_rows.stride(0),
        tiles, ROWS=per, BLOCK_N=block, num_warps=warps,
    )  # fmt: skip
    return dx, partial.sum(0).to(weight.dtype)
