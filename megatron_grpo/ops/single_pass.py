"""The single pass of ``fused_grpo_loss`` (token ratio): the loss and both gradients in one pass
over the vocabulary (3 GEMMs, no recompute), and the rule that chooses it over the tiled path.

Per full-width row chunk of the loss's valid rows: fp32 logits ``[C, n_valid]`` -> row stats
(kernel seam) -> TP combine of those rows -> logp / entropy -> ``loss.math.objective`` of the
chunk under autograd (d loss / d logp, d loss / d entropy) -> d logits (kernel seam, in place in
the GEMM dtype) -> ``dh_chunk = dlogits @ W`` and ``d_weight += dlogits^T @ h``, both with fp32
accumulation. The gradients are those of grad_output 1; the autograd Function in
:mod:`megatron_grpo.ops.fused_grpo` applies the real grad_output in backward. Why and when this
beats the tiled path: see that module's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.loss.math import LossContext, objective
from megatron_grpo.loss.metrics import MetricDict
from megatron_grpo.ops import tiling
from megatron_grpo.ops.comm import combine_row_stats
from megatron_grpo.ops.lm_head import LMHead, RowGrads, mm_f32, take_rows
from megatron_grpo.ops.passes import HiddenGrad
from megatron_grpo.ops.weight_grad import main_grad_of

# Smallest full-width row chunk worth the single pass (measurements: ops/fused_grpo.py).
SINGLE_PASS_MIN_ROWS = 4096
# An fp32 [V_local, H] d_weight buffer beyond the gradient may cost at most this many tiles.
ACCUMULATOR_TILES = 1


def needs_accumulator(weight: Tensor) -> bool:
    """Whether the single pass needs an fp32 [V_local, H] buffer beyond the gradient: neither an
    fp32 ``main_grad`` nor an fp32 gradient (fp32 weight) exists to accumulate into."""
    main_grad = main_grad_of(weight)
    if main_grad is not None:
        return main_grad.dtype != torch.float32
    return weight.dtype != torch.float32


def single_pass_rows(
    n_rows: int, v_local: int, hidden_size: int, chunk_size: int | None, extra_accumulator: bool
) -> int | None:
    """Rows per chunk of the single pass, or None when the tiled recompute path runs.

    A full-width fp32 [C, V_local] chunk must fit ``tiling.TILE_BYTES`` (C = ``chunk_size``, or
    as many rows as fit, 64-aligned) with C >= min(SINGLE_PASS_MIN_ROWS, n_rows), and an extra
    fp32 d_weight buffer (``extra_accumulator``) must cost at most ACCUMULATOR_TILES tiles.
    Depends only on values equal on all TP ranks (V_local, not the rank's valid columns), so
    every rank takes the same path and runs the same number of per-chunk collectives.
    """
    budget = tiling.TILE_BYTES
    fit = budget // (4 * max(v_local, 1))
    rows = tiling.round_down(fit, tiling.ROW_ALIGN) if chunk_size is None else chunk_size
    if n_rows == 0 or not 1 <= rows <= fit or rows < min(SINGLE_PASS_MIN_ROWS, n_rows):
        return None
    if extra_accumulator and 4 * v_local * hidden_size > ACCUMULATOR_TILES * budget:
        return None
    return min(rows, n_rows)


def objective_grads(
    cfg: GRPOLossConfig, lctx: LossContext, logp: Tensor, ent: Tensor | None, want_grad: bool
) -> tuple[Tensor, MetricDict, Tensor | None, Tensor | None]:
    """``loss.math.objective`` of the rows of ``lctx`` and, if wanted, its gradients w.r.t.
    logp / entropy ([n] each; the entropy one None when ``cfg.entropy_coef == 0``)."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_(want_grad)
        en = None if ent is None else ent.detach().requires_grad_(want_grad)
        loss, metrics = objective(cfg, lctx, lp, en)
        if not want_grad:
            return loss.detach(), metrics, None, None
        inputs = [lp] if en is None else [lp, en]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
    g_ent = grads[1] if en is not None and cfg.entropy_coef != 0 else None
    return loss.detach(), metrics, grads[0], g_ent


class ForwardWeightGrad:
    """d_weight of the single pass for grad_output 1, accumulated in fp32 during the forward.

    ``in_main_grad``: straight into an fp32 ``weight.main_grad`` (Megatron's DDP buffer: no
    [V_local, H] buffer of our own), which then already holds it before backward. Otherwise into
    ``acc``, an fp32 [V_local, H] buffer (padded rows 0): the fp32 weight's gradient itself, or
    an extra buffer (:func:`needs_accumulator`) rounded into the gradient in backward.
    """

    def __init__(self, weight: Tensor, n_valid: int):
        self.n_valid = n_valid
        main_grad = main_grad_of(weight)
        self.in_main_grad = main_grad is not None and main_grad.dtype == torch.float32
        if self.in_main_grad:
            self.acc = main_grad
        else:  # every valid row is written by the first chunk's GEMM: no zero fill
            self.acc = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
            self.acc[n_valid:].zero_()
        self._started = self.in_main_grad

    def add(self, dlogits: Tensor, h: Tensor) -> None:
        """``d_weight[:n_valid] += dlogits^T @ h`` (dlogits [C, n_valid], h [C, H])."""
        dst = self.acc[: self.n_valid]
        if self._started:
            mm_f32(dlogits.t(), h, acc=dst)
        else:
            mm_f32(dlogits.t(), h, out=dst)
            self._started = True


@dataclass
class SinglePassResult:
    """What the forward keeps: loss pieces, [N] outputs and the gradients of grad_output 1."""

    loss: Tensor  # fp32 scalar
    metrics: list[MetricDict]
    logp: Tensor  # [N]
    ent: Tensor | None  # [N]
    grads: RowGrads  # lse, d loss / d logp, d loss / d entropy, pz: [N] each
    dh: Tensor | None  # fp32 [T_local, H], TP-reduced


class TokenSinglePass:
    """One pass over the N loss rows (``t_local`` [N]) in chunks of ``rows`` full-width rows."""

    def __init__(self, head: LMHead, lctx: LossContext, cfg: GRPOLossConfig, need_ent: bool):
        self.head, self.lctx, self.cfg, self.need_ent = head, lctx, cfg, need_ent

    def run(
        self,
        h_full: Tensor,
        idx: Tensor | None,
        t_local: Tensor,
        rows: int,
        want_dh: bool,
        dw: ForwardWeightGrad | None,
    ) -> SinglePassResult:
        """h_full [T, H] (gathered), idx [N] or None (all rows); d_weight goes into ``dw``."""
        n, dev = t_local.shape[0], h_full.device
        stats = torch.empty((6 if self.need_ent else 3, n), device=dev)
        dh = HiddenGrad(self.head, h_full, idx, torch.float32) if want_dh else None
        buf = torch.empty(min(rows, n) * self.head.n_valid, device=dev)
        losses, metrics = [], [self.lctx.metrics]
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            h = take_rows(h_full, idx, r0, r1)
            loss, met = self._chunk(h, t_local[r0:r1], r0, r1, stats, buf, dh, dw)
            losses.append(loss)
            metrics.append(met)
        ent = g_ent = pz = None
        if self.need_ent:
            ent, pz = stats[4], stats[5]
            g_ent = stats[3] if self.cfg.entropy_coef != 0 else None
        grads = RowGrads(stats[1], stats[2], g_ent, None if g_ent is None else pz)
        total = torch.stack(losses).sum()
        return SinglePassResult(
            total, metrics, stats[0], ent, grads, None if dh is None else dh.finish()
        )

    def _chunk(self, h, t_rows, r0, r1, stats, buf, dh, dw) -> tuple[Tensor, MetricDict]:
        """Stats, loss and gradients of rows r0:r1; stats rows: logp, lse, g_lp, g_ent, ent, pz."""
        head = self.head
        lse, zt, pz = combine_row_stats(*self._local_stats(h, t_rows, buf), head.tp)
        logp = stats[0, r0:r1] = zt - lse
        stats[1, r0:r1] = lse
        ent = None
        if self.need_ent:
            ent = stats[4, r0:r1] = lse - pz
            stats[5, r0:r1] = pz
        loss, met, g_lp, g_ent = objective_grads(
            self.cfg, self.lctx.rows(slice(r0, r1)), logp, ent, want_grad=True
        )
        stats[2, r0:r1] = g_lp
        if g_ent is not None:
            stats[3, r0:r1] = g_ent
        if head.n_valid == 0:  # all-padded shard: no logits, zero local gradients
            if dh is not None:
                dh.put(r0, r1, h.new_zeros(h.shape, dtype=torch.float32))
            return loss, met
        g = RowGrads(lse, g_lp, g_ent, None if g_ent is None else pz)
        dlogits = head.dlogits(tiling.tile_view(buf, r1 - r0, head.n_valid), t_rows, 0, g)
        if dh is not None:
            dh.put(r0, r1, mm_f32(dlogits, head.weight[: head.n_valid]))
        if dw is not None:
            dw.add(dlogits, h)
        return loss, met

    def _local_stats(self, h: Tensor, t_rows: Tensor, buf: Tensor) -> list[Tensor | None]:
        """This shard's (m, s, zt, b) of the rows ``h``; the logits stay in ``buf``."""
        head, rows = self.head, h.shape[0]
        if head.n_valid == 0:
            parts = []
        else:
            logits = head.logits(h, 0, head.n_valid, buf)
            parts = [head.stats(logits, t_rows, 0, self.need_ent)]
        m, s, zt, b = tiling.merge_tile_stats(parts, rows, h.device)
        return [m, s, zt, b if self.need_ent else None]
