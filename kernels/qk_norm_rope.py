"""The attention's q and k heads RMS-normalized per head and rotated (RoPE), one launch each way.

Forward, per row ``x [D]`` of a q or k head (``w`` that tensor's norm weight, ``D`` the head dim):
``rstd = 1 / sqrt(mean(x^2) + eps)``, ``n = (x * rstd) * w`` in fp32, rounded to the model dtype
(the norm's output), then megatron-core's unfused RoPE on ``n``'s first ``ROT`` features,
``y = n * cos + rotate_half(n) * sin``, both products and the sum rounded to the model dtype
(``kernels.rope``'s contract). The rotation reads the partner feature ``p(i)`` (``i ^ 1``
interleaved, else ``(i + ROT / 2) mod ROT``), whose normalized value is recomputed from ``x[p(i)]``.
``rstd`` is kept (fp32 ``[T, n]``) for the backward.

Backward, from ``g = dL/dy``: the rotation's gradient ``dn`` with ``kernels.rope``'s roundings
(``dn[j] = g[j] * cos[j] - sign(j) * g[p(j)] * sin[p(j)]``), then RMSNorm's
``dx = rstd * (dn * w - xhat * mean(dn * w * xhat))`` with ``xhat = x * rstd``, and per-program
fp32 sums of ``dn * xhat`` for each weight's gradient (summed by the launcher). The result equals
``kernels.rms_norm`` followed by ``kernels.rope`` up to the mean's summation order, in one launch
for both tensors instead of four, and without the normalized tensors in memory between them.

One program takes a block of tokens of one head; heads ``[0, NQ)`` are q's, ``[NQ, NQ + NK)``
k's. fp32 is compiled without FMA contraction (the roundings above). The reference is
``megatron_grpo.ops.layers.qk_norm_rope.qk_norm_rope_torch``.
"""

from __future__ import annotations

import functools

import torch

from ._rounding import round_to
from ._runtime import check_device, interpret_mode, num_sms, require_triton
from .rope import rotation_partner

try:
    import triton
    import triton.language as tl
except ImportError:  # the launchers raise a clear error on use
    triton = None
    tl = None

BLOCK_T = 16
_STRIDES = ("sq_t", "sq_h", "sk_t", "sk_h", "gq_t", "gq_h", "gk_t", "gk_h")


def _fwd_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, rq_ptr, rk_ptr,
    T, sq_t, sq_h, sk_t, sk_h, stride_c, eps,
    NQ: tl.constexpr, NK: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    r64 = rows.to(tl.int64)[:, None]
    if h < NQ:
        x_row = q_ptr + r64 * sq_t + h.to(tl.int64) * sq_h
        w_ptr = wq_ptr
        o_row = qo_ptr + (r64 * NQ + h) * D
        r_ptr = rq_ptr + rows.to(tl.int64) * NQ + h
    else:
        x_row = k_ptr + r64 * sk_t + (h - NQ).to(tl.int64) * sk_h
        w_ptr = wk_ptr
        o_row = ko_ptr + (r64 * NK + (h - NQ)) * D
        r_ptr = rk_ptr + rows.to(tl.int64) * NK + (h - NQ)
    cols = tl.arange(0, BLOCK_D)
    partner, first = rotation_partner(cols, ROT, INTERLEAVED)
    ok_row = (rows < T)[:, None]
    ok = ok_row & (cols < D)[None, :]
    rot = (cols < ROT)[None, :]
    dtype = qo_ptr.dtype.element_ty
    x = tl.load(x_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(x_row + partner[None, :], mask=ok_row & rot, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + partner, mask=cols < ROT, other=0.0).to(tl.float32)[None, :]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    n = round_to((x * rstd[:, None]) * w, dtype)
    n_p = round_to((xp * rstd[:, None]) * wp, dtype)
    c = tl.load(cos_ptr + r64 * stride_c + cols[None, :], mask=ok_row & rot, other=0.0)
    s = tl.load(sin_ptr + r64 * stride_c + cols[None, :], mask=ok_row & rot, other=0.0)
    sign = tl.where(first, -1.0, 1.0)[None, :]
    a = round_to(n * c.to(tl.float32), dtype)
    b = round_to(n_p * s.to(tl.float32), dtype) * sign
    y = tl.where(rot, round_to(a + b, dtype), n)
    tl.store(o_row + cols[None, :], y.to(dtype), mask=ok)
    tl.store(r_ptr, rstd, mask=rows < T)


def _bwd_kernel(
    gq_ptr, gk_ptr, q_ptr, k_ptr, wq_ptr, wk_ptr, rq_ptr, rk_ptr, cos_ptr, sin_ptr,
    dq_ptr, dk_ptr, dw_ptr, T, tiles, gq_t, gq_h, gk_t, gk_h, sq_t, sq_h, sk_t, sk_h, stride_c,
    NQ: tl.constexpr, NK: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    h = tl.program_id(1)
    if h < NQ:  # scalar bases and strides of this head's tensor (one type in both branches)
        hh = h.to(tl.int64)
        g_base, g_t, x_base, x_t = gq_ptr + hh * gq_h, gq_t, q_ptr + hh * sq_h, sq_t
        w_ptr, heads, d_base = wq_ptr, h * 0 + NQ, dq_ptr + hh * D
        r_base = rq_ptr + hh
    else:
        hh = (h - NQ).to(tl.int64)
        g_base, g_t, x_base, x_t = gk_ptr + hh * gk_h, gk_t, k_ptr + hh * sk_h, sk_t
        w_ptr, heads, d_base = wk_ptr, h * 0 + NK, dk_ptr + hh * D
        r_base = rk_ptr + hh
    cols = tl.arange(0, BLOCK_D)
    partner, first = rotation_partner(cols, ROT, INTERLEAVED)
    col_ok = (cols < D)[None, :]
    rot = (cols < ROT)[None, :]
    sign = tl.where(first, 1.0, -1.0)[None, :]  # the partner's sign, negated
    dtype = dq_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for tile in range(pid, tiles, tl.num_programs(0)):
        rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        r64 = rows.to(tl.int64)[:, None]
        ok_row = (rows < T)[:, None]
        g_row = g_base + r64 * g_t
        g = tl.load(g_row + cols[None, :], mask=ok_row & col_ok, other=0.0).to(tl.float32)
        gp = tl.load(g_row + partner[None, :], mask=ok_row & rot, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + r64 * stride_c + cols[None, :], mask=ok_row & rot, other=0.0)
        s = tl.load(sin_ptr + r64 * stride_c + partner[None, :], mask=ok_row & rot, other=0.0)
        a = round_to(g * c.to(tl.float32), dtype)
        b = round_to(gp * s.to(tl.float32), dtype) * sign
        dn = tl.where(rot, round_to(a + b, dtype), g)
        x = tl.load(x_base + r64 * x_t + cols[None, :], mask=ok_row & col_ok, other=0.0)
        rstd = tl.load(r_base + rows.to(tl.int64) * heads, mask=rows < T, other=0.0)[:, None]
        xhat = x.to(tl.float32) * rstd
        gw = dn * w
        mean = tl.sum(gw * xhat, axis=1)[:, None] / D
        dx = (gw - xhat * mean) * rstd
        dx = round_to(dx, dtype).to(dtype)  # nearest even in the interpreter too
        tl.store(d_base + r64 * heads * D + cols[None, :], dx, mask=ok_row & col_ok)
        dw += tl.sum(dn * xhat, axis=0)
    tl.store(dw_ptr + (pid.to(tl.int64) * (NQ + NK) + h) * D + cols, dw, mask=cols < D)


@functools.cache
def _build(interpret: bool):
    """The kernels for one run mode; ``interpret`` keys the cache only. Strides are not
    specialized: the q and k branches must give their pointers one type."""
    require_triton()
    fwd = triton.jit(_fwd_kernel, do_not_specialize=["sq_t", "sq_h", "sk_t", "sk_h"])
    bwd = triton.jit(_bwd_kernel, do_not_specialize=list(_STRIDES))
    return fwd, bwd


def _check_heads(q: torch.Tensor, k: torch.Tensor, names=("q", "k")) -> tuple[int, int, int, int]:
    """``(T, NQ, NK, D)`` of ``q [T, NQ, D]`` and ``k [T, NK, D]`` (unit stride inside a head)."""
    for name, x in zip(names, (q, k), strict=True):
        check_device(name, x)
        if x.dim() != 3 or x.stride(-1) != 1:
            raise ValueError(
                f"{name} must be [T, n, d] with a contiguous last dim, got {list(x.shape)}"
            )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.dtype != k.dtype:
        raise ValueError(
            f"{names[0]} {list(q.shape)} {q.dtype} and {names[1]} {list(k.shape)} {k.dtype} must "
            "agree in tokens, head dim and dtype"
        )
    return q.size(0), q.size(1), k.size(1), q.size(2)


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, t: int, d: int, dtype) -> int:
    rot = cos.size(-1)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (t, rot) or not table.is_contiguous() or table.dtype != dtype:
            raise ValueError(
                f"{name} must be contiguous [T={t}, ROT] in {dtype}, got {list(table.shape)} "
                f"{table.dtype}"
            )
    if rot % 2 or rot > d:
        raise ValueError(f"the rotary dim ROT={rot} must be even and <= the head dim {d}")
    return rot


def _extra() -> dict:
    return {} if interpret_mode() else {"enable_fp_fusion": False}


def qk_norm_rope_fwd(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, *, interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``q [T, NQ, D]``, ``k [T, NK, D]`` (any token / head strides), weights ``[D]``, ``cos, sin
    [T, ROT]`` (contiguous, in q's dtype) -> ``(q_out, k_out, rstd_q [T, NQ], rstd_k [T, NK])``,
    the outputs new contiguous tensors in q's dtype, ``rstd`` fp32."""
    require_triton()
    t, nq, nk, d = _check_heads(q, k)
    rot = _check_tables(cos, sin, t, d, q.dtype)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (d,) or not w.is_contiguous() or w.dtype != q_weight.dtype:
            raise ValueError(
                f"{name} must be contiguous [D={d}] in q_weight's dtype, got {list(w.shape)} "
                f"{w.dtype}"
            )
    qo, ko = q.new_empty(t, nq, d), k.new_empty(t, nk, d)
    rq = torch.empty(t, nq, dtype=torch.float32, device=q.device)
    rk = torch.empty(t, nk, dtype=torch.float32, device=q.device)
    if t and d:
        fwd, _ = _build(interpret_mode())
        fwd[(triton.cdiv(t, BLOCK_T), nq + nk)](
            q, k, q_weight, k_weight, cos, sin, qo, ko, rq, rk, t, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), cos.stride(0), eps, NQ=nq, NK=nk, ROT=rot, D=d,
            BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(d), INTERLEAVED=interleaved,
            num_warps=4, **_extra(),
        )  # fmt: skip
    return qo, ko, rq, rk


def qk_norm_rope_bwd(
    grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, rstd_q: torch.Tensor, rstd_k: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients of :func:`qk_norm_rope_fwd` from ``grad_q [T, NQ, D]``, ``grad_k [T, NK, D]``:
    ``(dq, dk, dq_weight, dk_weight)``, ``dq, dk`` contiguous in q's dtype, the weights'
    gradients in their dtype (fp32 sums)."""
    require_triton()
    t, nq, nk, d = _check_heads(q, k)
    _check_heads(grad_q, grad_k, ("grad_q", "grad_k"))
    if grad_q.shape != q.shape or grad_k.shape != k.shape:
        raise ValueError(
            f"grad_q {list(grad_q.shape)} / grad_k {list(grad_k.shape)} must match q "
            f"{list(q.shape)} / k {list(k.shape)}"
        )
    rot = _check_tables(cos, sin, t, d, q.dtype)
    dq, dk = q.new_empty(t, nq, d), k.new_empty(t, nk, d)
    tiles = triton.cdiv(t, BLOCK_T) if t else 0
    if not tiles or not d:
        return dq, dk, torch.zeros_like(q_weight), torch.zeros_like(k_weight)
    programs = max(1, min(tiles, 4 * num_sms(q.device) // (nq + nk)))
    partial = torch.empty(programs, nq + nk, d, dtype=torch.float32, device=q.device)
    _, bwd = _build(interpret_mode())
    bwd[(programs, nq + nk)](
        grad_q, grad_k, q, k, q_weight, k_weight, rstd_q, rstd_k, cos, sin, dq, dk, partial, t,
        tiles, grad_q.stride(0), grad_q.stride(1), grad_k.stride(0), grad_k.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), NQ=nq, NK=nk,
        ROT=rot, D=d, BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(d),
        INTERLEAVED=interleaved, num_warps=4, **_extra(),
    )  # fmt: skip
    sums = partial.sum(0)  # [NQ + NK, D]
    return dq, dk, sums[:nq].sum(0).to(q_weight.dtype), sums[nq:].sum(0).to(k_weight.dtype)
