"""The single pass of ``fused_grpo_loss`` (token ratio): the loss and both gradients in one pass
over the vocabulary (3 GEMMs, no recompute). The plan chooses it (``ops.lm_head.plan``, path
"fused_single_pass") and sizes its chunks (``LMHeadPlan.chunk_rows``).

Per full-width row chunk of the loss's valid rows: logits ``[C, n_valid]`` (plan.gemm
"fused_epilogue": the GEMM's epilogue writes block statistics and bf16 shifted logits
``z - m_block``; "separate": fp32 logits, then the stats kernel) -> row stats
(kernel seam) -> TP combine of those rows -> logp / entropy -> ``loss.math.objective`` of the
chunk under autograd (d loss / d logp, d loss / d entropy) -> d logits (kernel seam, in place in
the GEMM dtype) -> ``dh_chunk = dlogits @ W`` and ``d_weight += dlogits^T @ h``, both with fp32
accumulation, d_weight summed over the chunks in the plan's accumulator (``ForwardWeightGrad``).
The gradients are those of grad_output 1; the autograd Function in
:mod:`megatron_grpo.ops.lm_head.fused_grpo` applies the real grad_output in backward. Why and when this
beats the tiled path: see that module's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.loss.math import LossContext, objective, raise_on_nonfinite
from megatron_grpo.loss.metrics import MetricDict
from megatron_grpo.ops.lm_head.comm import combine_row_stats
from megatron_grpo.ops.lm_head.gemm import mm_f32
from megatron_grpo.ops.lm_head.head import LMHead, take_rows
from megatron_grpo.ops.lm_head.passes import HiddenGrad
from megatron_grpo.ops.lm_head.stats import GlobalRowStats, RowGrads, RowStats
from megatron_grpo.ops.lm_head.tiling import merge_tile_stats, tile_view
from megatron_grpo.ops.lm_head.weight_grad import main_grad_of


def objective_grads(
    cfg: GRPOLossConfig, lctx: LossContext, logp: Tensor, ent: Tensor | None, want_grad: bool
) -> tuple[Tensor, MetricDict, Tensor | None, Tensor | None]:
    """``loss.math.objective`` of the rows of ``lctx`` and, if wanted, its gradients w.r.t.
    logp / entropy ([n] each; the entropy one None when ``cfg.entropy_coef == 0``). Host-sync
    free: the caller runs ``loss.math.raise_on_nonfinite`` on the rows once, afterwards."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_(want_grad)
        en = None if ent is None else ent.detach().requires_grad_(want_grad)
        loss, metrics = objective(cfg, lctx, lp, en, check_finite=False)
        if not want_grad:
            return loss.detach(), metrics, None, None
        inputs = [lp] if en is None else [lp, en]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
    g_ent = grads[1] if en is not None and cfg.entropy_coef != 0 else None
    return loss.detach(), metrics, grads[0], g_ent


class ForwardWeightGrad:
    """d_weight of the single pass for grad_output 1, summed over the chunks during the forward
    in the plan's ``accumulator`` (``ops.lm_head.plan``).

    "in_place": straight into an fp32 ``weight.main_grad`` (Megatron's DDP buffer:
    ``in_main_grad``, which then already holds it before backward) or the fp32 gradient of an
    fp32 weight (``acc``). "split": ``acc`` is the bf16 weight's new gradient and ``lo`` its int8
    residual (``kernels.split_accumulator``). "fp32": ``acc`` is an extra fp32 [V_local, H]
    buffer rounded into the gradient in backward. Padded vocabulary rows stay 0.
    """

    def __init__(self, head: LMHead):
        weight, self.n_valid, self.kernels = head.weight, head.n_valid, head.kernels
        kind = head.plan.accumulator
        main_grad = main_grad_of(weight)
        self.in_main_grad = kind == "in_place" and main_grad is not None
        self.lo = None
        if self.in_main_grad:
            self.acc = main_grad
        else:  # every valid row is written by the first chunk's GEMM: no zero fill
            dtype = torch.bfloat16 if kind == "split" else torch.float32
            self.acc = torch.empty(weight.shape, dtype=dtype, device=weight.device)
            self.acc[self.n_valid :].zero_()
            if kind == "split":
                self.lo = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
                self.lo[self.n_valid :].zero_()
        self._started = self.in_main_grad

    def add(self, dlogits: Tensor, h: Tensor) -> None:
        """``d_weight[:n_valid] += dlogits^T @ h`` (dlogits [C, n_valid], h [C, H])."""
        dst = self.acc[: self.n_valid]
        if self.lo is not None:
            self.kernels.split_acc_addmm(
                dlogits, h, dst, self.lo[: self.n_valid], not self._started
            )
        elif self._started:
            mm_f32(dlogits.t(), h, acc=dst)
        else:
            mm_f32(dlogits.t(), h, out=dst)
        self._started = True

    def scaled(self, scale: Tensor) -> Tensor:
        """The sum times grad_output ``scale`` (0-dim fp32), rounded once: the "split" pair
        resolved into the bf16 gradient, else the fp32 buffer scaled in place."""
        if self.lo is None:
            return self.acc.mul_(scale)
        grad = self.kernels.split_acc_resolve(self.acc, self.lo, scale.reshape(1))
        self.lo = None
        return grad


@dataclass
class PassRows:
    """Per-row results of the single pass, each [N] fp32, filled chunk by chunk."""

    logp: Tensor
    lse: Tensor
    g_logp: Tensor  # d loss / d logp (grad_output 1)
    g_ent: Tensor | None  # d loss / d entropy; None when the loss has no entropy term
    ent: Tensor | None  # entropy; None when not computed
    pz: Tensor | None  # sum_j p_j z_j (with entropy)

    @staticmethod
    def empty(n: int, device: torch.device, need_ent: bool, ent_grad: bool) -> PassRows:
        def new(on: bool = True) -> Tensor | None:
            return torch.empty(n, device=device) if on else None

        return PassRows(new(), new(), new(), new(ent_grad), new(need_ent), new(need_ent))

    def grads(self) -> RowGrads:
        """The logits gradient's per-row inputs (pz only with an entropy gradient)."""
        return RowGrads(self.lse, self.g_logp, self.g_ent, None if self.g_ent is None else self.pz)


@dataclass
class SinglePassResult:
    """What the forward keeps: loss pieces, [N] outputs and the gradients of grad_output 1."""

    loss: Tensor  # fp32 scalar
    metrics: list[MetricDict]
    rows: PassRows
    dh: Tensor | None  # fp32 [T_local, H], TP-reduced


class TokenSinglePass:
    """One pass over the N loss rows (``t_local`` [N]) in the plan's full-width chunks."""

    def __init__(self, head: LMHead, lctx: LossContext, cfg: GRPOLossConfig, need_ent: bool):
        self.head, self.lctx, self.cfg, self.need_ent = head, lctx, cfg, need_ent

    def run(
        self,
        h_full: Tensor,
        idx: Tensor | None,
        t_local: Tensor,
        want_dh: bool,
        dw: ForwardWeightGrad | None,
    ) -> SinglePassResult:
        """h_full [T, H] (gathered), idx [N] or None (all rows); d_weight goes into ``dw``."""
        n, dev, rows = t_local.shape[0], h_full.device, self.head.plan.chunk_rows
        ent_grad = self.need_ent and self.cfg.entropy_coef != 0
        out = PassRows.empty(n, dev, self.need_ent, ent_grad)
        # d_hidden rows are final in one GEMM each (K = the whole shard): at TP 1 kept in the
        # hidden dtype (backward's grad_output scale is then exact for 1 only), else fp32 for
        # the TP sum.
        dh = HiddenGrad(self.head, h_full, idx, h_full.dtype) if want_dh else None
        dtype = self.head.weight.dtype if self.head.epilogue else torch.float32
        buf = torch.empty(min(rows, n) * self.head.n_valid, dtype=dtype, device=dev)
        losses, metrics = [], [self.lctx.metrics]
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            h = take_rows(h_full, idx, r0, r1)
            loss, met = self._chunk(h, t_local[r0:r1], r0, r1, out, buf, dh, dw, r1 == n)
            losses.append(loss)
            metrics.append(met)
        total = torch.stack(losses).sum()
        return SinglePassResult(total, metrics, out, None if dh is None else dh.finish())

    def _chunk(
        self, h, t_rows, r0, r1, out: PassRows, buf, dh, dw, last: bool
    ) -> tuple[Tensor, MetricDict]:
        """Stats, loss and gradients of rows r0:r1, written into ``out``."""
        head = self.head
        local, shift = self._local_stats(h, t_rows, buf)
        st = combine_row_stats(local, head.tp)
        logp = out.logp[r0:r1] = st.logp
        out.lse[r0:r1] = st.lse
        ent = None
        if self.need_ent:
            ent = out.ent[r0:r1] = st.entropy
            out.pz[r0:r1] = st.pz
        loss, met, g_lp, g_ent = objective_grads(
            self.cfg, self.lctx.rows(slice(r0, r1)), logp, ent, want_grad=True
        )
        out.g_logp[r0:r1] = g_lp
        if g_ent is not None:
            out.g_ent[r0:r1] = g_ent
        if last:
            # One finiteness check (host sync) for all rows, before the last chunk's gradient
            # GEMMs are queued: the pass's tail then runs on the host while they run (a sync per
            # chunk would idle the GPU while the next is launched). A raise leaves main_grad
            # with the earlier chunks' part of this step.
            raise_on_nonfinite(self.cfg, out.logp, out.ent)
        if head.n_valid == 0:  # all-padded shard: no logits, zero local gradients
            if dh is not None:
                dh.put(r0, r1, h.new_zeros(h.shape, dtype=torch.float32))
            return loss, met
        self._backward_chunk(h, t_rows, r0, r1, st, g_lp, g_ent, buf, shift, dh, dw)
        return loss, met

    def _backward_chunk(
        self, h, t_rows, r0, r1, st: GlobalRowStats, g_lp, g_ent, buf, shift, dh, dw
    ) -> None:
        """d logits of the chunk still in ``buf``, then its d_hidden and d_weight GEMMs."""
        head = self.head
        g = RowGrads(st.lse, g_lp, g_ent, None if g_ent is None else st.pz)
        logits = tile_view(buf, r1 - r0, head.n_valid)
        if shift is None:
            dlogits = head.dlogits(logits, t_rows, 0, g)
        else:
            dlogits = head.shifted_dlogits(logits, t_rows, shift, g)
        if dh is not None:
            dh.put(r0, r1, mm_f32(dlogits, head.weight[: head.n_valid]))
        if dw is not None:
            dw.add(dlogits, h)

    def _local_stats(
        self, h: Tensor, t_rows: Tensor, buf: Tensor
    ) -> tuple[RowStats, Tensor | None]:
        """This shard's stats of the rows ``h`` and the fused GEMM's block shifts (None: fp32
        logits); the (shifted) logits stay in ``buf``."""
        head = self.head
        if head.epilogue and head.n_valid:
            return head.shifted_stats(h, t_rows, self.need_ent, buf)
        parts = []
        if head.n_valid:
            logits = head.logits(h, 0, head.n_valid, buf)
            parts = [head.stats(logits, t_rows, 0, self.need_ent)]
        return merge_tile_stats(parts, h.shape[0], h.device, self.need_ent), None
