"""Torch reference of the log-prob kernel seam (same signatures as ``megatron_grpo.kernels``).

Both functions work on one row-chunk of this rank's fp32 logits ``[C, V_local]`` (raw, before
temperature). Columns ``>= n_valid`` are padded vocabulary rows of the weight: they never enter
a max, a sum or a gradient. A target outside ``[0, n_valid)`` means "not in this shard".
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.ops.kernels import RESIDUAL_BITS
from megatron_grpo.ops.lm_head.gemm import mm_f32


def _target_hits(targets_local: Tensor, n_valid: int) -> tuple[Tensor, Tensor]:
    """Returns (in-shard mask [C] bool, safe column index [C, 1] int64)."""
    hit = (targets_local >= 0) & (targets_local < n_valid)
    col = torch.where(hit, targets_local, torch.zeros_like(targets_local))
    return hit, col.unsqueeze(1)


def logits_row_stats(
    logits: Tensor,
    targets_local: Tensor,
    n_valid: int,
    inv_temperature: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Per-row local softmax statistics of ``z = logits * inv_temperature`` on valid columns.

    Args:
        logits: [C, V_local] float32.
        targets_local: [C] int64, global target id minus this shard's first vocab id.
        n_valid: number of real (non-padded) columns, ``0 <= n_valid <= V_local``.
    Returns:
        ``(m, s, zt, b)``, each [C] float32: ``m = max z`` (-inf if n_valid == 0),
        ``s = sum exp(z - m)``, ``zt = z[target]`` (0 when not in this shard),
        ``b = sum exp(z - m) * z`` (None unless ``with_entropy``).
    """
    rows = logits.shape[0]
    hit, col = _target_hits(targets_local, n_valid)
    if n_valid == 0:
        zeros = logits.new_zeros(rows)
        m = torch.full_like(zeros, float("-inf"))
        return m, zeros, zeros.clone(), (zeros.clone() if with_entropy else None)
    zt = torch.where(hit, logits.gather(1, col).squeeze(1) * inv_temperature, 0.0)
    d = logits[:, :n_valid] * inv_temperature  # [C, n_valid], becomes z - m below
    m = d.amax(dim=1)
    d.sub_(m.unsqueeze(1))
    e = torch.exp(d)
    s = e.sum(dim=1)
    b = None
    if with_entropy:
        # sum e * z = sum e * (z - m) + m * s: the shifted form keeps the products small.
        b = e.mul_(d).sum(dim=1) + m * s
    return m, s, zt, b


def logits_grad(
    logits: Tensor,
    targets_local: Tensor,
    n_valid: int,
    inv_temperature: float,
    lse: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor | None = None,
    entropy_pz: Tensor | None = None,
    out: Tensor | None = None,
    block_shift: Tensor | None = None,
    shift_block: int = 0,
) -> Tensor:
    """d(loss)/d(logits) of one row-chunk from the global statistics.

    With ``p = exp(z - lse)`` on valid columns:
    ``dz = grad_logp * (onehot(target) - p) - grad_entropy * p * (z - entropy_pz)`` and the
    result is ``dz * inv_temperature``; padded columns get 0.

    Args:
        logits: [C, V_local] float32 raw logits.
        lse: [C] global log-sum-exp of z; entropy_pz: [C] global ``sum_j p_j z_j``.
        grad_logp, grad_entropy: [C] float32.
        out: optional [C, V_local] output (any float dtype; may be ``logits`` itself).
        block_shift: optional [NB, C] fp32: ``logits`` then holds shifted tempered logits (see
            :func:`head_gemm_stats`) and ``z = logits + block_shift[col // shift_block]``.
    Returns:
        [C, V_local] in ``out``'s dtype (or ``logits.dtype``).
    """
    if (grad_entropy is None) != (entropy_pz is None):
        raise ValueError("logits_grad: grad_entropy and entropy_pz must be given together")
    if out is None:
        out = torch.empty_like(logits)
    if n_valid == 0:
        return out.zero_()
    hit, col = _target_hits(targets_local, n_valid)
    if block_shift is None:
        z = logits[:, :n_valid] * inv_temperature  # copy: `out` may alias `logits`
    else:
        shift = block_shift.t().repeat_interleave(shift_block, dim=1)[:, :n_valid]
        z = logits[:, :n_valid].float() + shift
    p = torch.exp(z - lse.unsqueeze(1))
    if grad_entropy is None:
        dz = p.mul_(-grad_logp.unsqueeze(1))
    else:
        # -p * (g_lp + g_ent * (z - pz)), reusing z's buffer for the bracket.
        z.sub_(entropy_pz.unsqueeze(1)).mul_(grad_entropy.unsqueeze(1))
        z.add_(grad_logp.unsqueeze(1))
        dz = p.mul_(z).neg_()
    dz.scatter_add_(1, col, (grad_logp * hit).unsqueeze(1))
    dz.mul_(inv_temperature)
    out[:, :n_valid].copy_(dz)
    out[:, n_valid:].zero_()
    return out


# Columns per block of the fused GEMM's statistics (``kernels.head_gemm.STATS_BLOCK_N``).
STATS_BLOCK = 256


def head_gemm_stats(
    h: Tensor,
    w: Tensor,
    targets_local: Tensor,
    inv_temperature: float,
    with_entropy: bool,
    shifted: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Per-block statistics of ``z = (h @ w^T) * inv_temperature`` (``kernels.head_gemm``).

    Args:
        h: [M, H]; w: [N, H] (every column valid); targets_local: [M] int64.
        shifted: optional [M, N] output in w's dtype for ``z - m`` of each element's block.
    Returns:
        ``(m, s, zt, b)``, each [NB, M] fp32, NB = cdiv(N, :data:`STATS_BLOCK`): the statistics
        of :func:`logits_row_stats` over each block of columns.
    """
    rows, n = h.shape[0], w.shape[0]
    nb = -(-n // STATS_BLOCK)
    z = mm_f32(h, w.t()) * inv_temperature  # [M, N] fp32
    pad = torch.full((rows, nb * STATS_BLOCK - n), float("-inf"), device=z.device)
    zb = torch.cat([z, pad], dim=1).view(rows, nb, STATS_BLOCK)
    m = zb.amax(dim=2)  # [M, NB], finite: every block has a column
    d = zb - m.unsqueeze(2)
    e = torch.exp(d)
    s = e.sum(dim=2)
    cols = torch.arange(nb * STATS_BLOCK, device=z.device).view(nb, STATS_BLOCK)
    hit = (cols.unsqueeze(0) == targets_local.view(rows, 1, 1)) & (cols < n).unsqueeze(0)
    zt = torch.where(hit, zb, 0.0).sum(dim=2)
    b = (e * torch.where(torch.isfinite(d), d, 0.0)).sum(dim=2) + m * s if with_entropy else None
    if shifted is not None:
        shifted.copy_(d.reshape(rows, -1)[:, :n])
    b_t = None if b is None else b.t().contiguous()
    return m.t().contiguous(), s.t().contiguous(), zt.t().contiguous(), b_t


def head_gemm_grad(
    h: Tensor,
    w: Tensor,
    targets_local: Tensor,
    inv_temperature: float,
    lse: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor | None = None,
    entropy_pz: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """d loss / d logits [M, N] of ``logits = h @ w^T`` (``kernels.head_gemm``), in ``out`` or a
    new tensor of w's dtype."""
    logits = mm_f32(h, w.t())
    if out is None:
        out = torch.empty(logits.shape, dtype=w.dtype, device=w.device)
    n = w.shape[0]
    return logits_grad(
        logits, targets_local, n, inv_temperature, lse, grad_logp, grad_entropy, entropy_pz, out
    )


# The split accumulator (``kernels.split_accumulator``): scale(hi) = 2^(e - SPLIT_BITS).
SPLIT_BITS = RESIDUAL_BITS
_SPLIT_SLICE_BYTES = 64 * 2**20  # fp32 scratch per slice of rows: bounded, like the kernel's


def split_scale(hi: Tensor) -> Tensor:
    """``2^(e - SPLIT_BITS)`` of fp32 ``hi`` (``2^e`` its power of two, floored to a normal)."""
    field = (hi.view(torch.int32) & 0x7F800000).clamp(min=(SPLIT_BITS + 1) << 23)
    return (field - (SPLIT_BITS << 23)).view(torch.float32)


def _split_slices(hi: Tensor):
    step = max(1, _SPLIT_SLICE_BYTES // (4 * max(hi.shape[1], 1)))
    return (slice(m0, min(m0 + step, hi.shape[0])) for m0 in range(0, hi.shape[0], step))


def split_acc_addmm(a: Tensor, b: Tensor, hi: Tensor, lo: Tensor, first: bool) -> None:
    """``hi, lo <- split(hi + lo * scale(hi) + a^T @ b)`` in place (``kernels.split_accumulator``):
    a [K, M], b [K, N], hi [M, N] bf16, lo [M, N] int8; ``first``: the pair is only written."""
    for rows in _split_slices(hi):
        acc = mm_f32(a[:, rows].t(), b)
        if not first:
            old = hi[rows].float()
            acc += old + lo[rows].float() * split_scale(old)
        new = acc.to(torch.bfloat16)
        q = ((acc - new.float()) / split_scale(new.float())).round_().clamp_(-127, 127)
        hi[rows] = new
        lo[rows] = q.to(torch.int8)


def split_acc_resolve(hi: Tensor, lo: Tensor, scale: Tensor) -> Tensor:
    """``hi <- round(scale * (hi + lo * scale(hi)))`` in place; ``scale`` a one-element fp32
    tensor. Returns ``hi``."""
    for rows in _split_slices(hi):
        old = hi[rows].float()
        hi[rows] = ((old + lo[rows].float() * split_scale(old)) * scale).to(hi.dtype)
    return hi
