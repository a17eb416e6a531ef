"""Torch reference of the log-prob kernel seam (same signatures as ``megatron_grpo.kernels``).

Both functions work on one row-chunk of this rank's fp32 logits ``[C, V_local]`` (raw, before
temperature). Columns ``>= n_valid`` are padded vocabulary rows of the weight: they never enter
a max, a sum or a gradient. A target outside ``[0, n_valid)`` means "not in this shard".
"""

from __future__ import annotations

import torch
from torch import Tensor


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
    z = logits[:, :n_valid] * inv_temperature  # copy: `out` may alias `logits`
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
