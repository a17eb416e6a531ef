"""Decode attention over a KV cache: one new query token per row, each row its own length.

``q [b, G, R, D]`` (the R query heads of KV head g, the GQA-folded layout), ``k/v_cache[i, g,
:pos[i] + 1]`` for row i (cache slot i) -> ``out [b, G, R, D]``. Keys past a row's length are
never read (a masked dense call reads the whole context bucket of every row).

Split-K (flash decoding): programs (row, group, split) each take a range of the row's keys in
blocks of ``block_n`` (:func:`tile`: 32 or 64 by the grid's size), keep an online softmax per
query head in fp32 and write a partial ``(m, l, acc)``; splits past a row's length exit at once.
A second kernel merges the splits and rounds once to the model dtype. The query heads of a group are one tensor-core tile (padded to
16 rows), so every key block is read once for all of them; fp32 inputs use IEEE products.
The reference is ``torch.nn.functional.scaled_dot_product_attention`` with a key-padding mask.
"""

from __future__ import annotations

import functools

import torch

from ._runtime import check_device, interpret_mode, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the launcher raises a clear error on use
    triton = None
    tl = None

BLOCK_N = 64


def _split_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
    stride_slot, stride_group, stride_pos, chunk, scale, R, D,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    split = tl.program_id(2)
    groups = tl.num_programs(1)
    splits = tl.num_programs(2)
    rr = tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_D)
    nn = tl.arange(0, BLOCK_N)
    q_mask = (rr[:, None] < R) & (dd[None, :] < D)
    q = tl.load(q_ptr + ((row * groups + g) * R + rr[:, None]) * D + dd[None, :], mask=q_mask)
    if DOT_F32:
        q = q.to(tl.float32)
    length = tl.load(pos_ptr + row) + 1
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    base = row * stride_slot + g * stride_group
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + nn
        kv_mask = (keys[:, None] < end) & (dd[None, :] < D)
        off = base + keys[:, None] * stride_pos + dd[None, :]
        k = tl.load(k_ptr + off, mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_R, BLOCK_N]
        s = tl.where(keys[None, :] < end, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + off, mask=kv_mask, other=0.0)
        pv = p.to(v.dtype)  # P @ V on the tensor cores in the cache's dtype
        if DOT_F32:
            pv, v = pv.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        m_i = m_new
    out = ((row * groups + g) * splits + split) * R + rr
    tl.store(m_ptr + out, m_i, mask=rr < R)
    tl.store(l_ptr + out, l_i, mask=rr < R)
    tl.store(acc_ptr + out[:, None] * D + dd[None, :], acc, mask=q_mask)


def _merge_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, R, D, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    r = tl.program_id(2)
    groups = tl.num_programs(1)
    dd = tl.arange(0, BLOCK_D)
    first = ((row * groups + g) * SPLITS) * R + r
    m = tl.load(m_ptr + first)
    for s in range(1, SPLITS):  # the splits' max (a split past the row's length holds -inf)
        m = tl.maximum(m, tl.load(m_ptr + first + s * R))
    l_sum = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(SPLITS):
        at = first + s * R
        m_s = tl.load(m_ptr + at)
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m))
        l_sum += w * tl.load(l_ptr + at)
        acc += w * tl.load(acc_ptr + at * D + dd, mask=dd < D, other=0.0)
    dest = out_ptr + ((row * groups + g) * R + r) * D + dd
    tl.store(dest, (acc / l_sum).to(out_ptr.dtype.element_ty), mask=dd < D)


@functools.cache
def _build(interpret: bool):
    """The kernels for one run mode; ``interpret`` keys the cache only."""
    require_triton()
    return triton.jit(_split_kernel), triton.jit(_merge_kernel)


# A grid of more than 2 and at most 4 programs (row, group, split) an SM takes 32-key blocks on 2
# warps: all of its programs stay resident in one wave (64 keys on 4 warps keep about 2 an SM).
# One H200, one TP 4 rank of the 8B (G 2) at 256 rows (512 programs): 24.5 / 40.0 / 84.4 us at
# contexts of 260 / 520 / 1288 against 28.7 / 45.6 / 94.7; at 128-256 programs and at 1024 the
# 64-key tile was as fast or ahead by up to 1.25x (tools/bench_decode_attention.py, calls
# replayed from a CUDA graph).
SMALL_TILE_PER_SM = (2, 4)


def num_splits(b: int, groups: int, ctx: int, sms: int = 132) -> int:
    """Key splits per (row, group): enough programs for one wave of the GPU, at least 256 keys
    a split. A function of shapes only, so a CUDA graph's launch is fixed. (Two waves took 2
    splits at 256 programs: 28.3 us against 23.9 with one, G 4 at 64 rows and 520 keys.)"""
    want = -(-sms // max(b * groups, 1))
    return max(1, min(want, ctx // 256))


def tile(programs: int, sms: int = 132) -> tuple[int, int]:
    """``(block_n, num_warps)`` of the split kernel for a grid of ``programs``."""
    low, high = SMALL_TILE_PER_SM
    return (32, 2) if low * sms < programs <= high * sms else (BLOCK_N, 4)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
    ctx: int, scale: float, *, splits: int | None = None, block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``q [b, G, R, D]`` contiguous, row i attending to ``k/v_cache[i, :, :pos[i] + 1]``
    (``[slots >= b, G, S, D]``, D contiguous); ``ctx >= max(pos) + 1`` bounds the split sizes.
    ``splits``: key splits per (row, group) (None: :func:`num_splits`); ``block_n`` keys a
    step and ``num_warps``: the split kernel's tile (None: :func:`tile`;
    ``tools/bench_decode_attention.py`` sweeps them). Returns ``[b, G, R, D]`` in q's dtype."""
    require_triton()
    check_device("q", q)
    b, groups, heads, d = q.shape
    if not q.is_contiguous() or k_cache.shape[1] != groups or k_cache.shape[3] != d:
        raise ValueError(f"q must be contiguous [b, G, R, D] matching the cache, got "
                         f"{list(q.shape)} and {list(k_cache.shape)}")  # fmt: skip
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must have equal strides, D contiguous")
    if pos.shape != (b,) or pos.dtype != torch.int64:
        raise ValueError(f"pos must be int64 [{b}], got {pos.dtype} {list(pos.shape)}")
    splits = num_splits(b, groups, ctx) if splits is None else splits
    auto_n, auto_warps = tile(b * groups * splits)
    block_n = auto_n if block_n is None else block_n
    num_warps = auto_warps if num_warps is None else num_warps
    if splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"splits must be >= 1 and block_n a power of two >= 16, got "
                         f"{splits}, {block_n}")  # fmt: skip
    chunk = -(-ctx // splits)
    f32 = dict(dtype=torch.float32, device=q.device)
    m = torch.empty(b, groups, splits, heads, **f32)
    l_ = torch.empty(b, groups, splits, heads, **f32)
    acc = torch.empty(b, groups, splits, heads, d, **f32)
    out = torch.empty_like(q)
    if b == 0:
        return out
    interpret = interpret_mode()  # its tl.dot mishandles bf16: products in fp32 there
    split_kernel, merge_kernel = _build(interpret)
    block_d = triton.next_power_of_2(d)
    split_kernel[(b, groups, splits)](
        q, k_cache, v_cache, pos, m, l_, acc,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), chunk, float(scale), heads, d,
        BLOCK_R=max(16, triton.next_power_of_2(heads)), BLOCK_D=block_d, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32",
        DOT_F32=interpret, num_warps=num_warps,
    )  # fmt: skip
    merge_kernel[(b, groups, heads)](m, l_, acc, out, heads, d, SPLITS=splits, BLOCK_D=block_d)
    return out
