"""One decode step's fused QKV epilogue: q/k RMSNorm, RoPE, and the K/V cache write.

Input: the QKV GEMM's output ``qkv [b, G * (R + 2) * D]`` in megatron-core's layout (per query
group ``g``: its ``R`` query heads, then one key and one value head). For row ``i`` (cache slot
``i``) at position ``pos[i]``:

* query heads: optional RMSNorm over D, RoPE -> ``q [b, G, R, D]`` (query heads grouped by
  their KV head: the GQA-folded layout the decode attention reads);
* key head: optional RMSNorm, RoPE -> ``k_cache[i, g, pos[i]]``;
* value head: -> ``v_cache[i, g, pos[i]]``.

Roundings follow megatron-core's module path in the model dtype: the norm's output, ``t * cos``,
``rotate_half(t) * sin`` and their sum are each rounded (RoPE is applied to the first ``ROT``
features, the rest pass through). One program per (row, group, head).
The reference is ``megatron_grpo.ops.layers.decode.qkv_rope_cache_torch``.
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


def _qkv_rope_cache_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, q_ptr,
    stride_qkv, stride_slot, stride_group, stride_pos, eps, R, D, ROT,
    HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    h = tl.program_id(2)
    groups = tl.num_programs(1)
    dtype = q_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    src = qkv_ptr + row * stride_qkv + (g * (R + 2) + h) * D
    pos = tl.load(pos_ptr + row)
    cache_off = row * stride_slot + g * stride_group + pos * stride_pos + cols
    x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
    if h == R + 1:  # value
        tl.store(v_ptr + cache_off, x.to(dtype), mask=ok)
    else:
        rot = ok & (cols < ROT)
        if INTERLEAVED:  # rotate_half: (x0, x1, ...) -> (-x1, x0, ...)
            partner = cols ^ 1
            sign = tl.where(cols % 2 == 0, -1.0, 1.0)
        else:  # (x1, x2) -> (-x2, x1) over the rotary features
            half = ROT // 2
            partner = tl.where(cols < half, cols + half, cols - half)
            sign = tl.where(cols < half, -1.0, 1.0)
        xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
        if HAS_NORM:
            if h == R:
                w_ptr = kw_ptr
            else:
                w_ptr = qw_ptr
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            x = round_to(x * rstd * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32), dtype)
            wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
            xp = round_to(xp * rstd * wp, dtype)
        out = x
        if HAS_ROPE:
            c = tl.load(cos_ptr + pos * ROT + cols, mask=rot, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + pos * ROT + cols, mask=rot, other=0.0).to(tl.float32)
            a = round_to(x * c, dtype)
            b = round_to(sign * xp * s, dtype)
            out = tl.where(rot, round_to(a + b, dtype), out)
        out = out.to(dtype)
        if h == R:
            tl.store(k_ptr + cache_off, out, mask=ok)
        else:
            tl.store(q_ptr + ((row * groups + g) * R + h) * D + cols, out, mask=ok)


@functools.cache
def _build(interpret: bool):
    """The kernel for one run mode; ``interpret`` keys the cache only."""
    require_triton()
    return triton.jit(_qkv_rope_cache_kernel)


def qkv_rope_cache(
    qkv: torch.Tensor,
    groups: int,
    heads_per_group: int,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
) -> torch.Tensor:
    """Write row ``i``'s key and value at ``k/v_cache[i, :, pos[i]]``; return ``q [b, G, R, D]``.

    Args:
        qkv: ``[b, G * (R + 2) * D]``, last dim contiguous.
        pos: ``[b]`` int64 positions (row i is cache slot i).
        k_cache, v_cache: ``[slots, G, S, D]`` with D contiguous, ``slots >= b``.
        norm: ``(q_weight [D], k_weight [D], eps)`` of the q/k RMSNorms, or None.
        rope: ``(cos, sin, interleaved)``, tables ``[S_table, ROT]`` contiguous, or None.
    """
    require_triton()
    check_device("qkv", qkv)
    b, width = qkv.shape
    d = k_cache.size(-1)
    if width != groups * (heads_per_group + 2) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [b, {groups} * ({heads_per_group} + 2) * {d}], got "
                         f"{list(qkv.shape)}")  # fmt: skip
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.size(0) < b:
        raise ValueError("k_cache and v_cache must be [slots >= b, G, S, D] with equal strides")
    if pos.shape != (b,) or pos.dtype != torch.int64:
        raise ValueError(f"pos must be int64 [{b}], got {pos.dtype} {list(pos.shape)}")
    q = torch.empty(b, groups, heads_per_group, d, dtype=qkv.dtype, device=qkv.device)
    qw, kw, eps = norm if norm is not None else (None, None, 0.0)
    cos, sin, interleaved = rope if rope is not None else (None, None, False)
    rot = cos.size(-1) if cos is not None else 0
    if b:
        _build(interpret_mode())[(b, groups, heads_per_group + 2)](
            qkv, qw, kw, cos, sin, pos, k_cache, v_cache, q,
            qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            float(eps), heads_per_group, d, rot,
            HAS_NORM=norm is not None, HAS_ROPE=rope is not None, INTERLEAVED=bool(interleaved),
            BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 128 else 2,
        )  # fmt: skip
    return q
