"""The LM-head GEMM with a softmax epilogue: logits never round-trip HBM in fp32.

``acc = h @ w^T`` ([M, K] x [N, K] -> [M, N], fp32 accumulator) is computed block by block
(``BLOCK_M x BLOCK_N``, grouped ordering for L2 reuse of ``w``) and reduced in registers by one
of two epilogues, with ``z = acc * inv_temperature``:

* stats: per (vocab block j, row i) ``m = max z``, ``s = sum exp(z - m)``, ``zt = z[target]``
  (0 unless the target is in the block) and ``b = sum exp(z - m) z`` into ``[NB, M]`` fp32
  partials (``NB = cdiv(N, BLOCK_N)``), merged over blocks by ``ops.lm_head.stats.merge_row_stats``.
  Optionally the block also stores ``z - m`` (shifted logits) in ``w``'s dtype into
  ``shifted [M, N]``: near the row maximum, where the probability mass is, the shift keeps the
  stored value small, so its rounding error is that of a small number, not of ``|z|``
  (``logits_grad``'s ``block_shift`` adds ``m`` back).
* grad: from the row's global ``lse``, ``g_logp`` (and ``g_ent``, ``pz``), with
  ``p = exp(z - lse)``: ``dlogits = inv_temperature * (g_logp (onehot - p) - g_ent p (z - pz))``
  stored in ``out``'s dtype (``[M, N]``), the input of the d_hidden and d_weight GEMMs.

Only the ``N`` columns given are computed (the caller passes the valid vocabulary rows of the
shard); targets outside ``[0, N)`` hit no column. Under Triton's CPU interpreter (whose
``tl.dot`` mishandles bf16 and whose bf16 cast truncates) the products are taken in fp32 and the
stores rounded to nearest even on the bits.
"""

from __future__ import annotations

import functools

import torch

from ._rounding import round_to
from ._runtime import (
    autotune_enabled,
    check_device,
    check_row_vector,
    check_scalars,
    interpret_mode,
    num_sms,
    require_triton,
    tma_aligned,
    tma_kind,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the launchers raise a clear error on use
    triton = None
    tl = None

# Pointer kernel default (autotuning only with MEGATRON_GRPO_AUTOTUNE=1): 128 x 256 fp32
# accumulator in 8 warps, 64-deep K steps, 4 stages of shared memory (the fastest of
# ``_configs()`` on an H200, tools/bench_head_gemm.py).
CONFIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
# The persistent TMA kernel's default: 3 stages (faster than 2 or 4 and than 128-deep K steps on
# an H200; Triton's warp specialization of the tile loop measured no faster: docs/benchmarks.md).
# TMA_STORE: the output tile (shifted logits / d logits) leaves by a TMA store when its rows are
# 16-byte aligned (else by pointers): the pointer tile spilled 0.4-2.5 KB a thread (triton 3.6);
# on an H200 stats + shifted logits went from 1.16x to 1.095x cuBLAS (docs/benchmarks.md).
TMA_CONFIG = dict(BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA_STORE=True)
STATS_BLOCK_N = CONFIG["BLOCK_N"]  # the vocab block of the stats partials (fixed: see _configs)
_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _head_gemm_kernel(
    h_ptr, w_ptr, t_ptr,
    m_ptr, s_ptr, zt_ptr, b_ptr, shifted_ptr,
    lse_ptr, glp_ptr, gent_ptr, pz_ptr, out_ptr,
    M, N, K, stride_h, stride_w, stride_o, inv_t,
    GRAD: tl.constexpr, HAS_ENTROPY: tl.constexpr, STORE_SHIFTED: tl.constexpr,
    DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows / columns load a valid row instead (no masks in the main loop); the
    # epilogue masks them.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    a_ptrs = h_ptr + rows[:, None] * stride_h + offs_k[None, :]
    b_ptrs = w_ptr + cols[None, :] * stride_w + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    _tile_epilogue(acc, pid_m, pid_n, M, N, inv_t, t_ptr, m_ptr, s_ptr, zt_ptr, b_ptr,
                   shifted_ptr, lse_ptr, glp_ptr, gent_ptr, pz_ptr, out_ptr, stride_o, GRAD,
                   HAS_ENTROPY, STORE_SHIFTED, DOT_F32, BLOCK_M, BLOCK_N, False)  # fmt: skip


def _head_gemm_tma_kernel(
    h_desc, w_desc, t_ptr,
    m_ptr, s_ptr, zt_ptr, b_ptr, shifted_ptr,
    lse_ptr, glp_ptr, gent_ptr, pz_ptr, out_ptr,
    M, N, K, stride_o, inv_t,
    GRAD: tl.constexpr, HAS_ENTROPY: tl.constexpr, STORE_SHIFTED: tl.constexpr,
    DOT_F32: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA_STORE: tl.constexpr,
):  # fmt: skip
    """The same GEMM + epilogues, persistent (one program per SM) with TMA loads (Hopper+):
    the flattened tile loop lets the next tile's loads overlap this tile's epilogue."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        group_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):  # TMA zero-fills out-of-range rows, columns and K
            a = h_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            if DOT_F32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
        _tile_epilogue(acc, pid_m, pid_n, M, N, inv_t, t_ptr, m_ptr, s_ptr, zt_ptr, b_ptr,
                       shifted_ptr, lse_ptr, glp_ptr, gent_ptr, pz_ptr, out_ptr, stride_o, GRAD,
                       HAS_ENTROPY, STORE_SHIFTED, DOT_F32, BLOCK_M, BLOCK_N,
                       TMA_STORE)  # fmt: skip


def _tile_epilogue(
    acc, pid_m, pid_n, M, N, inv_t, t_ptr, m_ptr, s_ptr, zt_ptr, b_ptr, shifted_ptr,
    lse_ptr, glp_ptr, gent_ptr, pz_ptr, out_ptr, stride_o,
    GRAD: tl.constexpr, HAS_ENTROPY: tl.constexpr, STORE_SHIFTED: tl.constexpr,
    ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA_STORE: tl.constexpr,
):  # fmt: skip
    """Both kernels' epilogue of output tile (pid_m, pid_n): the stats or the gradient.
    ``TMA_STORE``: ``shifted_ptr`` / ``out_ptr`` are tensor descriptors of [BLOCK_M, BLOCK_N]
    blocks (no per-element pointers in registers)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    col_ok = offs_n < N
    z = acc * inv_t
    target = tl.load(t_ptr + offs_m, mask=row_ok, other=-1)
    hit = (offs_n[None, :] == target[:, None]) & col_ok[None, :]
    if GRAD:
        _grad_epilogue(z, hit, col_ok, row_ok, offs_m, offs_n, lse_ptr, glp_ptr, gent_ptr, pz_ptr,
                       out_ptr, stride_o, inv_t, HAS_ENTROPY, ROUND, TMA_STORE, pid_m * BLOCK_M,
                       pid_n * BLOCK_N)  # fmt: skip
    else:
        _stats_epilogue(z, hit, col_ok, row_ok, offs_m, offs_n, pid_n, M, m_ptr, s_ptr, zt_ptr,
                        b_ptr, shifted_ptr, stride_o, HAS_ENTROPY, STORE_SHIFTED, ROUND,
                        TMA_STORE, pid_m * BLOCK_M, pid_n * BLOCK_N)  # fmt: skip


def _stats_epilogue(
    z, hit, col_ok, row_ok, offs_m, offs_n, pid_n, M, m_ptr, s_ptr, zt_ptr, b_ptr, shifted_ptr,
    stride_o, HAS_ENTROPY: tl.constexpr, STORE_SHIFTED: tl.constexpr, ROUND: tl.constexpr,
    TMA_STORE: tl.constexpr, row0, col0,
):  # fmt: skip
    part = pid_n.to(tl.int64) * M + offs_m
    # zt first: z is then needed only for z - m (fewer tiles live at once)
    tl.store(zt_ptr + part, tl.sum(tl.where(hit, z, 0.0), axis=1), mask=row_ok)
    z = tl.where(col_ok[None, :], z, float("-inf"))
    m = tl.max(z, axis=1)  # finite: every block has a valid column
    d = tl.where(col_ok[None, :], z - m[:, None], 0.0)
    e = tl.where(col_ok[None, :], tl.exp(d), 0.0)
    s = tl.sum(e, axis=1)
    tl.store(m_ptr + part, m, mask=row_ok)
    tl.store(s_ptr + part, s, mask=row_ok)
    if HAS_ENTROPY:
        # sum e z = sum e (z - m) + m s: the shifted form keeps the products small.
        tl.store(b_ptr + part, tl.sum(e * d, axis=1) + m * s, mask=row_ok)
    if STORE_SHIFTED:
        _store_tile(shifted_ptr, d, offs_m, offs_n, row_ok, col_ok, stride_o, ROUND, TMA_STORE,
                    row0, col0)  # fmt: skip


def _grad_epilogue(
    z, hit, col_ok, row_ok, offs_m, offs_n, lse_ptr, glp_ptr, gent_ptr, pz_ptr, out_ptr,
    stride_o, inv_t, HAS_ENTROPY: tl.constexpr, ROUND: tl.constexpr, TMA_STORE: tl.constexpr,
    row0, col0,
):  # fmt: skip
    lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
    g = tl.load(glp_ptr + offs_m, mask=row_ok, other=0.0)
    p = tl.exp(tl.where(col_ok[None, :], z - lse[:, None], float("-inf")))
    dz = g[:, None] * (tl.where(hit, 1.0, 0.0) - p)
    if HAS_ENTROPY:
        ge = tl.load(gent_ptr + offs_m, mask=row_ok, other=0.0)
        pz = tl.load(pz_ptr + offs_m, mask=row_ok, other=0.0)
        dz -= ge[:, None] * p * tl.where(col_ok[None, :], z - pz[:, None], 0.0)
    _store_tile(out_ptr, dz * inv_t, offs_m, offs_n, row_ok, col_ok, stride_o, ROUND, TMA_STORE,
                row0, col0)  # fmt: skip


def _store_tile(dst, val, offs_m, offs_n, row_ok, col_ok, stride_o, ROUND: tl.constexpr,
                TMA_STORE: tl.constexpr, row0, col0):  # fmt: skip
    """fp32 ``val`` rounded into the output tile: by a tensor descriptor (TMA clips the edges)
    or by pointers."""
    if TMA_STORE:
        out = round_to(val, dst.dtype) if ROUND else val
        dst.store([row0, col0], out.to(dst.dtype))
    else:
        ptrs = dst + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
        out = round_to(val, dst.dtype.element_ty) if ROUND else val
        tl.store(ptrs, out.to(dst.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


if triton is not None:  # helpers are jitted at import, like _rounding.round_to
    _store_tile = triton.jit(_store_tile)
    _stats_epilogue = triton.jit(_stats_epilogue)
    _grad_epilogue = triton.jit(_grad_epilogue)
    _tile_epilogue = triton.jit(_tile_epilogue)


def _configs() -> list:
    # BLOCK_N stays STATS_BLOCK_N: the stats partials and the shifted logits' blocks use it.
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=st)
        for bm, bk, w, st in [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 4), (64, 64, 4, 4)]
    ]  # fmt: skip


@functools.cache
def _build_tma():
    require_triton()
    return triton.jit(_head_gemm_tma_kernel)


def kernel_kind(h: torch.Tensor, w: torch.Tensor, kernel: str | None = None) -> str:
    """Which kernel runs (one place): ``kernel`` when given, else "tma" (persistent, TMA
    loads) on Hopper and newer GPUs for 16-bit operands whose rows are 16-byte aligned, else
    "pointer" (``_runtime.tma_kind``)."""
    if kernel is None and h.dtype == torch.float32:
        return "pointer"
    return tma_kind((h, w), kernel)


@functools.cache
def _build(interpret: bool, autotune: bool):
    """The kernel for one (interpreter, autotune) mode; ``interpret`` keys the cache only."""
    require_triton()
    kernel = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(
        triton.jit(_head_gemm_kernel)
    )
    if autotune:  # grad mode overwrites nothing it reads: no restore needed
        kernel = triton.autotune(configs=_configs(), key=["M", "N", "K", "GRAD"])(kernel)
    return kernel


def _check_inputs(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> None:
    for name, x in (("h", h), ("w", w)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, got {getattr(x, 'shape', type(x))}")
        if x.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along its last (hidden) dimension")
        check_device(name, x)
    if h.dtype != w.dtype or h.dtype not in _GRAD_DTYPES:
        raise ValueError(f"h and w must share a float dtype, got {h.dtype} and {w.dtype}")
    if h.shape[1] != w.shape[1] or h.device != w.device:
        raise ValueError(f"h {list(h.shape)} and w {list(w.shape)} must share H and device")
    check_row_vector("targets_local", targets, h.shape[0], torch.int64, h.device)


def _launch_tma(h, w, targets, inv_t, ptrs, *, grad, entropy, shifted, out_stride) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = dict(TMA_CONFIG)
    store = cfg.pop("TMA_STORE")
    m_rows, n_cols, k_dim = h.shape[0], w.shape[0], h.shape[1]
    h_desc = TensorDescriptor.from_tensor(h, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    w_desc = TensorDescriptor.from_tensor(w, [STATS_BLOCK_N, cfg["BLOCK_K"]])
    tiles = triton.cdiv(m_rows, cfg["BLOCK_M"]) * triton.cdiv(n_cols, STATS_BLOCK_N)
    sms = num_sms(h.device)
    at = _OUT_AT if grad else _SHIFTED_AT
    ptrs, tma_store = _store_descriptor(ptrs, at, cfg["BLOCK_M"]) if store else (ptrs, False)
    _build_tma()[(min(sms, tiles),)](
        h_desc, w_desc, targets, *ptrs, m_rows, n_cols, k_dim, out_stride, float(inv_t),
        GRAD=grad, HAS_ENTROPY=entropy, STORE_SHIFTED=shifted,
        DOT_F32=interpret_mode() or h.dtype == torch.float32,
        NUM_SMS=sms,
        BLOCK_N=STATS_BLOCK_N, TMA_STORE=tma_store, **cfg,
    )  # fmt: skip


# where the output tile's tensor sits in a launch's ``ptrs`` (the kernels' argument order)
_SHIFTED_AT, _OUT_AT = 4, 9


def _store_descriptor(ptrs: tuple, at: int, block_m: int) -> tuple[tuple, bool]:
    """``ptrs`` with its output tensor ``ptrs[at]`` as a tensor descriptor of
    [block_m, STATS_BLOCK_N] blocks, when it exists and its rows are 16-byte aligned."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = ptrs[at]
    if out is None or not tma_aligned(out):
        return ptrs, False
    desc = TensorDescriptor.from_tensor(out, [block_m, STATS_BLOCK_N])
    return (*ptrs[:at], desc, *ptrs[at + 1 :]), True


def _launch(h, w, targets, inv_t, ptrs, *, grad, entropy, shifted, out_stride, kernel) -> None:
    if kernel_kind(h, w, kernel) == "tma":
        return _launch_tma(h, w, targets, inv_t, ptrs, grad=grad, entropy=entropy,
                           shifted=shifted, out_stride=out_stride)  # fmt: skip
    m_rows, n_cols, k_dim = h.shape[0], w.shape[0], h.shape[1]
    interpret = interpret_mode()
    autotune = autotune_enabled() and not interpret
    kernel = _build(interpret, autotune)
    tune = {} if autotune else {k: v for k, v in CONFIG.items() if k != "BLOCK_N"}

    def grid(meta):
        return (triton.cdiv(m_rows, meta["BLOCK_M"]) * triton.cdiv(n_cols, STATS_BLOCK_N),)

    kernel[grid](
        h, w, targets, *ptrs, m_rows, n_cols, k_dim, h.stride(0), w.stride(0), out_stride,
        float(inv_t), GRAD=grad, HAS_ENTROPY=entropy, STORE_SHIFTED=shifted,
        DOT_F32=interpret or h.dtype == torch.float32,
        BLOCK_N=STATS_BLOCK_N, **tune,
    )  # fmt: skip


def head_gemm_stats(
    h: torch.Tensor,
    w: torch.Tensor,
    targets_local: torch.Tensor,
    inv_temperature: float,
    with_entropy: bool,
    shifted: torch.Tensor | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-block softmax statistics of ``z = (h @ w^T) * inv_temperature`` (module docstring).

    Args:
        h: [M, K] rows (bf16 / fp16 / fp32, last dim contiguous).
        w: [N, K] vocabulary rows, same dtype.
        targets_local: [M] int64 target column (outside [0, N): none in these columns).
        inv_temperature: 1 / temperature, finite and > 0.
        with_entropy: also return b.
        shifted: optional [M, N] output (w's dtype, last dim contiguous) for ``z - m`` of each
            element's block.
        kernel: None (:func:`kernel_kind` decides), "tma" or "pointer".

    Returns:
        (m, s, zt, b), each [NB, M] fp32 with NB = cdiv(N, STATS_BLOCK_N) (b None unless
        with_entropy). With N = 0 (or M = 0) the arrays are empty.
    """
    require_triton()
    _check_inputs(h, w, targets_local)
    rows, n_cols = h.shape[0], w.shape[0]
    check_scalars(n_cols, n_cols, inv_temperature)
    if shifted is not None:
        _check_out("shifted", shifted, (rows, n_cols), w.dtype, h.device)
    nb = triton.cdiv(n_cols, STATS_BLOCK_N)
    f32 = dict(dtype=torch.float32, device=h.device)
    m, s, zt = (torch.empty(nb, rows, **f32) for _ in range(3))
    b = torch.empty(nb, rows, **f32) if with_entropy else None
    if rows and n_cols:
        ptrs = (m, s, zt, b, shifted, None, None, None, None, None)
        _launch(h, w, targets_local, inv_temperature, ptrs, grad=False, entropy=with_entropy,
                shifted=shifted is not None,
                out_stride=0 if shifted is None else shifted.stride(0), kernel=kernel)  # fmt: skip
    return m, s, zt, b


def head_gemm_grad(
    h: torch.Tensor,
    w: torch.Tensor,
    targets_local: torch.Tensor,
    inv_temperature: float,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None = None,
    entropy_pz: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """d loss / d logits ``[M, N]`` of ``logits = h @ w^T``, straight from the GEMM.

    Args:
        h, w, targets_local, inv_temperature: as :func:`head_gemm_stats`.
        lse: [M] fp32 global log-sum-exp of z; grad_logp: [M] fp32 d loss / d logp.
        grad_entropy, entropy_pz: [M] fp32 d loss / d entropy and sum_j p_j z_j, or both None.
        out: [M, N] output (last dim contiguous), or None for a new one in w's dtype.
        kernel: None (:func:`kernel_kind` decides), "tma" or "pointer".
    """
    require_triton()
    _check_inputs(h, w, targets_local)
    rows, n_cols = h.shape[0], w.shape[0]
    check_scalars(n_cols, n_cols, inv_temperature)
    for name, x in (("lse", lse), ("grad_logp", grad_logp)):
        check_row_vector(name, x, rows, torch.float32, h.device)
    if (grad_entropy is None) != (entropy_pz is None):
        raise ValueError("grad_entropy and entropy_pz must be given together (or both None)")
    if grad_entropy is not None:
        check_row_vector("grad_entropy", grad_entropy, rows, torch.float32, h.device)
        check_row_vector("entropy_pz", entropy_pz, rows, torch.float32, h.device)
    if out is None:
        out = torch.empty(rows, n_cols, dtype=w.dtype, device=h.device)
    _check_out("out", out, (rows, n_cols), None, h.device)
    if rows and n_cols:
        ptrs = (None, None, None, None, None, lse, grad_logp, grad_entropy, entropy_pz, out)
        _launch(h, w, targets_local, inv_temperature, ptrs, grad=True,
                entropy=grad_entropy is not None, shifted=False, out_stride=out.stride(0),
                kernel=kernel)  # fmt: skip
    return out


def _check_out(name, out, shape, dtype, device) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        raise ValueError(f"{name} must be a {list(shape)} tensor, got {getattr(out, 'shape', out)}")
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} (the weight's dtype), got {out.dtype}")
    if out.dtype not in _GRAD_DTYPES or out.device != device:
        raise ValueError(f"{name} must be a float tensor on {device}, got {out.dtype} {out.device}")
    if shape[1] > 1 and out.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension")
