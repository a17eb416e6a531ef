"""Rows gathered by index and summed per output row in one pass: the MoE dispatches' combines
(each token's expert rows) and the backward of their row gathers.

    out[n, :] = sum over s of src[idx[n, s], :]    (idx[n, s] >= M: no row; fp32 sums)

``src [M, D]``, ``idx [N, S]`` int64 -> ``out [N, D]`` in ``out_dtype``. The torch reference
(``ops.layers.gather_sum``) appends a zero row to ``src`` (a copy of all ``M`` rows), gathers
``[N, S, D]`` and sums it: three passes over memory, where this reads each used row once and
writes each output row once. Each program takes one output row and a block of columns; the S
rows are added in slot order, as the reference's sum does; the fp32 sum is rounded to
``out_dtype`` to nearest even (``_rounding``: the CPU interpreter's cast truncates).
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

MAX_BLOCK_D = 1024  # columns per program (fewer for narrow rows: the probs' D = 1)
NUM_WARPS = 4


def _gather_sum_kernel(
    src_ptr, idx_ptr, out_ptr, M, D, src_stride, out_stride,
    S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in tl.static_range(S):
        j = tl.load(idx_ptr + row * S + s)
        used = j < M
        # an unused slot reads row 0 (cached; M > 0 here) and adds nothing
        v = tl.load(src_ptr + tl.where(used, j, 0) * src_stride + cols, mask=col_ok, other=0.0)
        acc += tl.where(used, v.to(tl.float32), 0.0)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * out_stride + cols, round_to(acc, out_ty).to(out_ty), mask=col_ok)


@functools.cache
def _build(interpret: bool):
    """The kernel for one run mode; ``interpret`` keys the cache only."""
    require_triton()
    return triton.jit(_gather_sum_kernel)


def gather_sum(src: torch.Tensor, idx: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``src [M, D]`` (unit column stride), ``idx [N, S]`` int64 -> ``[N, D]`` in ``out_dtype``:
    row n is the fp32 sum of ``src``'s rows ``idx[n, :]`` (indices >= M add nothing)."""
    require_triton()
    check_device("src", src)
    if src.dim() != 2 or (src.size(1) > 1 and src.stride(1) != 1):
        raise ValueError(f"src must be [M, D] with unit column stride, got {list(src.shape)}")
    if idx.dim() != 2 or idx.dtype != torch.int64:
        raise ValueError(f"idx must be a [N, S] int64 tensor, got {idx.dtype} {list(idx.shape)}")
    n, s = idx.shape
    m, d = src.shape
    if m == 0:  # every slot unused
        return torch.zeros(n, d, dtype=out_dtype, device=src.device)
    out = torch.empty(n, d, dtype=out_dtype, device=src.device)
    if n and d:
        block = min(MAX_BLOCK_D, max(16, triton.next_power_of_2(d)))
        grid = (n, triton.cdiv(d, block))
        _build(interpret_mode())[grid](
            src, idx.contiguous(), out, m, d, src.stride(0), out.stride(0),
            S=s, BLOCK_D=block, num_warps=NUM_WARPS if block >= 512 else 1,
        )  # fmt: skip
    return out
