"""A 16-bit gradient with an int8 residual: fp32-grade accumulation of d_weight across GEMMs.

The single pass adds one row chunk's ``dlogits^T @ h`` into d_weight per chunk. Without an fp32
buffer (a bf16 weight without ``main_grad``) rounding the running sum to bf16 after every chunk
would add one bf16 rounding per chunk; an fp32 buffer costs 4 bytes per weight element. Here the
sum is kept as ``hi + lo * scale(hi)``: ``hi`` the bf16 gradient itself (``[M, N]``, every
element rounded to nearest) and ``lo`` an int8 ``[M, N]`` residual in units of
``scale(hi) = 2^(e - 14)`` (``2^e``: ``hi``'s power of two), i.e. 1/128 of ``hi``'s ulp. The
residual of a rounding to nearest is at most half an ulp, so ``|lo| <= 64``: the pair holds the
sum to about 2^-15 of its magnitude (fp32 keeps 2^-24, bf16 alone 2^-8) for 1 byte per element
over the gradient.

* :func:`split_acc_addmm`: ``hi, lo <- split(hi + lo * scale(hi) + a^T @ b)`` with ``a`` the
  ``[K, M]`` d logits of a chunk and ``b`` its ``[K, N]`` hidden rows: one GEMM (fp32
  accumulator) whose epilogue reads and writes the pair (``first``: the pair is not read, it is
  the first chunk). Persistent with TMA loads on Hopper+ (the tile loop walks the ``N`` blocks
  of one ``M`` block in turn, so the ``[K, BLOCK_M]`` slice of ``a`` is read from HBM once),
  else a plain grid.
* :func:`split_acc_resolve`: ``hi <- round(scale * (hi + lo * scale(hi)))``, the gradient for
  autograd's grad_output ``scale`` ([1] fp32 on the device, no host sync), rounded once.

Under Triton's CPU interpreter (whose ``tl.dot`` mishandles bf16 and whose bf16 cast truncates)
the products are taken in fp32 and ``hi`` is rounded to nearest even on the bits.
"""

from __future__ import annotations

import functools

import torch

from ._rounding import round_to
from ._runtime import check_device, interpret_mode, num_sms, require_triton, tma_kind

try:
    import triton
    import triton.language as tl
except ImportError:  # the launchers raise a clear error on use
    triton = None
    tl = None

# 128 x 128 output tiles in 8 warps (128 x 256 exceeds the shared memory), 64-deep K steps, 4
# stages: 4.10 ms a 1344-row chunk on an H200 (3 stages 4.54; tools/bench_head_gemm.py).
# CTAS_PER_SM: persistent programs per SM (the TMA kernel). With 2, one program's epilogue (the
# pair's read and write) can run beside the other's main loop if both fit an SM, which takes
# smaller tiles: measured slower (best 4.51 ms, 128 x 64 tiles in 4 warps, 3 stages).
CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, CTAS_PER_SM=1)
RESIDUAL_BITS = 14  # scale(hi) = 2^(e - 14): 1/128 of a bf16 ulp (7 stored mantissa bits)
_BITS = None if tl is None else tl.constexpr(RESIDUAL_BITS)  # what jit code may read


def _scale_of(hi):
    """``2^(e - RESIDUAL_BITS)`` of fp32 values ``hi`` (their exponent field, floored so the
    scale stays a normal fp32 number: zeros and tiny values get the smallest one)."""
    field = hi.to(tl.int32, bitcast=True) & 0x7F800000
    field = tl.maximum(field, (_BITS + 1) << 23)
    return (field - (_BITS << 23)).to(tl.float32, bitcast=True)


def _split(acc, old, res, FIRST: tl.constexpr, ROUND: tl.constexpr):
    """(hi bf16, lo int8) of ``old + res * scale(old) + acc`` (``old``/``res``: the pair as
    fp32, unread when ``FIRST``)."""
    if not FIRST:
        acc += old + res * _scale_of(old)
    if ROUND:
        new = round_to(acc, tl.bfloat16)
    else:
        new = acc.to(tl.bfloat16).to(tl.float32)
    q = _rint((acc - new) / _scale_of(new))  # exact: the residual of a rounding, a power of 2
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    return new.to(tl.bfloat16), q.to(tl.int8)


def _split_epilogue(acc, pid_m, pid_n, M, N, hi_ptr, lo_ptr, stride, FIRST: tl.constexpr,
                    ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """``(hi, lo) <- split(hi + lo * scale(hi) + acc)`` of output tile (pid_m, pid_n)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    at = offs_m.to(tl.int64)[:, None] * stride + offs_n[None, :]
    old = acc
    res = acc
    if not FIRST:
        old = tl.load(hi_ptr + at, mask=ok, other=0.0).to(tl.float32)
        res = tl.load(lo_ptr + at, mask=ok, other=0).to(tl.float32)
    hi, lo = _split(acc, old, res, FIRST, ROUND)
    tl.store(hi_ptr + at, hi, mask=ok)
    tl.store(lo_ptr + at, lo, mask=ok)


def _rint(x):
    """Round to nearest (halves away from zero: the residual's last unit, either is fine)."""
    return tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(0.5 - x))


def _addmm_kernel(a_ptr, b_ptr, hi_ptr, lo_ptr, M, N, K, stride_a, stride_b, stride_o,
                  FIRST: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One program per output tile; ``a`` [K, M], ``b`` [K, N] (last dims contiguous)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    cols_m = offs_m % M  # out-of-range columns read a valid one; the epilogue masks them
    cols_n = offs_n % N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(a_ptr + kk.to(tl.int64)[:, None] * stride_a + cols_m[None, :],
                    mask=k_ok[:, None], other=0.0)  # fmt: skip
        b = tl.load(b_ptr + kk.to(tl.int64)[:, None] * stride_b + cols_n[None, :],
                    mask=k_ok[:, None], other=0.0)  # fmt: skip
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32).T, b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.T, b, acc)
    _split_epilogue(acc, pid_m, pid_n, M, N, hi_ptr, lo_ptr, stride_o, FIRST, DOT_F32, BLOCK_M,
                    BLOCK_N)  # fmt: skip


def _addmm_tma_kernel(a_desc, b_desc, hi_desc, lo_desc, M, N, K, FIRST: tl.constexpr,
                      DOT_F32: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Persistent (``NUM_PROGRAMS``: CTAS_PER_SM per SM), TMA loads and stores (the pair's
    tiles too: no per-element pointers in registers); N blocks of one M block are consecutive."""
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * num_n, NUM_PROGRAMS, flatten=True):
        pid_m = tile // num_n
        pid_n = tile % num_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):  # TMA zero-fills out-of-range rows, columns and K
            a = a_desc.load([k * BLOCK_K, pid_m * BLOCK_M])
            b = b_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
            if DOT_F32:
                acc = tl.dot(a.to(tl.float32).T, b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a.T, b, acc)
        at = [pid_m * BLOCK_M, pid_n * BLOCK_N]  # TMA clips the stores at the edges
        old = acc
        res = acc
        if not FIRST:
            old = hi_desc.load(at).to(tl.float32)
            res = lo_desc.load(at).to(tl.float32)
        hi, lo = _split(acc, old, res, FIRST, DOT_F32)
        hi_desc.store(at, hi)
        lo_desc.store(at, lo)


def _resolve_kernel(hi_ptr, lo_ptr, scale_ptr, n, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    old = tl.load(hi_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(lo_ptr + offs, mask=ok, other=0).to(tl.float32)
    val = (old + res * _scale_of(old)) * tl.load(scale_ptr)
    val = round_to(val, tl.bfloat16) if ROUND else val
    tl.store(hi_ptr + offs, val.to(tl.bfloat16), mask=ok)


if triton is not None:  # helpers are jitted at import, like _rounding.round_to
    _scale_of = triton.jit(_scale_of)
    _rint = triton.jit(_rint)
    _split = triton.jit(_split)
    _split_epilogue = triton.jit(_split_epilogue)


@functools.cache
def _build(name: str):
    require_triton()
    fn = {"tma": _addmm_tma_kernel, "pointer": _addmm_kernel, "resolve": _resolve_kernel}[name]
    return triton.jit(fn)


def check_pair(hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``hi`` bf16 and ``lo`` int8 of one shape, contiguous, on one device."""
    if not isinstance(hi, torch.Tensor) or hi.dtype != torch.bfloat16 or hi.dim() != 2:
        raise ValueError(f"hi must be a 2-D bfloat16 tensor, got {getattr(hi, 'dtype', hi)}")
    if not isinstance(lo, torch.Tensor) or lo.dtype != torch.int8 or lo.shape != hi.shape:
        raise ValueError(f"lo must be an int8 tensor of hi's shape {list(hi.shape)}, got "
                         f"{getattr(lo, 'dtype', lo)} {list(getattr(lo, 'shape', []))}")  # fmt: skip
    if not (hi.is_contiguous() and lo.is_contiguous()) or hi.device != lo.device:
        raise ValueError("hi and lo must be contiguous and on one device")
    check_device("hi", hi)


def split_acc_addmm(
    a: torch.Tensor,
    b: torch.Tensor,
    hi: torch.Tensor,
    lo: torch.Tensor,
    first: bool,
    kernel: str | None = None,
    config: dict | None = None,
) -> None:
    """``hi, lo <- split(hi + lo * scale(hi) + a^T @ b)`` in place (module docstring).

    Args:
        a: [K, M] (e.g. a chunk's d logits [C, V]), b: [K, N] (its hidden rows [C, H]); one
            16-bit or fp32 dtype, last dims contiguous.
        hi: [M, N] bfloat16, lo: [M, N] int8, contiguous (rows of a larger pair may be given).
        first: the pair holds nothing yet (it is written, not read).
        kernel: None (``_runtime.tma_kind`` decides), "tma" or "pointer".
        config: tile sizes, warps, stages and programs per SM (default :data:`CONFIG`).
    """
    require_triton()
    check_pair(hi, lo)
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.stride(-1) != 1:
            raise ValueError(f"{name} must be a 2-D tensor contiguous along its last dimension")
        check_device(name, x)
    if a.dtype != b.dtype or a.shape[0] != b.shape[0] or (a.shape[1], b.shape[1]) != hi.shape:
        raise ValueError(f"a {list(a.shape)} {a.dtype} and b {list(b.shape)} {b.dtype} must "
                         f"share dtype and K, with [M, N] = hi's {list(hi.shape)}")  # fmt: skip
    m_rows, n_cols, k_dim = hi.shape[0], hi.shape[1], a.shape[0]
    if m_rows == 0 or n_cols == 0:
        return
    if k_dim == 0:  # nothing to add: the pair is already split (first: it becomes 0)
        if first:
            hi.zero_()
            lo.zero_()
        return
    cfg = {**CONFIG, **(config or {})}
    ctas = cfg.pop("CTAS_PER_SM")
    if not isinstance(ctas, int) or ctas < 1:
        raise ValueError(f"config CTAS_PER_SM must be a positive int, got {ctas!r}")
    dot_f32 = interpret_mode() or a.dtype == torch.float32
    tiles = triton.cdiv(m_rows, cfg["BLOCK_M"]) * triton.cdiv(n_cols, cfg["BLOCK_N"])
    if tma_kind((a, b, hi, lo), kernel) == "pointer":
        _build("pointer")[(tiles,)](
            a, b, hi, lo, m_rows, n_cols, k_dim, a.stride(0), b.stride(0), hi.stride(0),
            FIRST=first, DOT_F32=dot_f32, **cfg,
        )  # fmt: skip
        return
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_desc = TensorDescriptor.from_tensor(a, [cfg["BLOCK_K"], cfg["BLOCK_M"]])
    b_desc = TensorDescriptor.from_tensor(b, [cfg["BLOCK_K"], cfg["BLOCK_N"]])
    hi_desc, lo_desc = (TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_N"]])
                        for x in (hi, lo))  # fmt: skip
    programs = min(ctas * num_sms(a.device), tiles)
    _build("tma")[(programs,)](
        a_desc, b_desc, hi_desc, lo_desc, m_rows, n_cols, k_dim, FIRST=first,
        DOT_F32=dot_f32, NUM_PROGRAMS=programs, **cfg,
    )  # fmt: skip


def split_acc_resolve(hi: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``hi <- round(scale * (hi + lo * scale(hi)))`` in place; returns ``hi``. ``scale``: a
    one-element fp32 tensor on hi's device (read on the device)."""
    require_triton()
    check_pair(hi, lo)
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != hi.device:
        raise ValueError(f"scale must be a one-element float32 tensor on {hi.device}")
    n, block = hi.numel(), 4096
    if n:
        _build("resolve")[(triton.cdiv(n, block),)](
            hi, lo, scale, n, ROUND=interpret_mode(), BLOCK=block, num_warps=8
        )
    return hi
