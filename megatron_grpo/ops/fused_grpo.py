"""``fused_grpo_loss``: the GRPO loss straight from hidden states and the LM-head shard.

ratio_level "token" (one pass, 3 GEMMs, no recompute): the loss context (``loss.math``) is built
once; then per chunk of the loss's valid rows: fp32 logits -> row stats -> TP combine ->
log-probs (and entropy, only when needed) -> ``loss.math.objective`` on the chunk under
autograd, giving d loss / d logp and d loss / d entropy -> d logits from the same logits chunk ->
d_hidden and d_weight GEMMs. All of it runs in the forward of an autograd.Function; its backward
only scales the saved fp32 gradients by the incoming grad_output. Until then it holds an fp32
[T_local, H] d_hidden and an fp32 [V_local, H] d_weight buffer.

ratio_level "sequence" (GSPO): a token's ratio depends on every token of its sequence, so the
loss cannot be finished chunk by chunk. It runs ``vocab_parallel_logprobs`` (rows = loss mask),
then ``grpo_loss``, and autograd through the op, which recomputes the logits in backward.

Prompt tokens (loss_mask False) never reach the LM head in either mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.loss import GRPOLossConfig, grpo_loss
from megatron_grpo.loss.math import LossContext, build_context, objective
from megatron_grpo.loss.metrics import MetricDict, merge_metrics
from megatron_grpo.ops.comm import TPInfo, combine_row_stats
from megatron_grpo.ops.lm_head import LMHead, build_lm_head, check_targets, take_rows
from megatron_grpo.ops.logprobs import (
    gather_hidden,
    local_targets,
    reduce_hidden_grad,
    scatter_rows,
    vocab_parallel_logprobs,
)
from megatron_grpo.ops.weight_grad import finish_weight_grad, weight_grad_accumulator


def _chunk_objective(
    cfg: GRPOLossConfig, ctx: LossContext, logp: Tensor, ent: Tensor | None
) -> tuple[Tensor, MetricDict, Tensor, Tensor | None]:
    """Objective of one chunk and its gradients w.r.t. logp / entropy ([n] each)."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        en = None if ent is None else ent.detach().requires_grad_()
        loss, metrics = objective(cfg, ctx, lp, en)
        inputs = [lp] if en is None else [lp, en]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
    g_ent = grads[1] if en is not None and cfg.entropy_coef != 0 else None
    return loss.detach(), metrics, grads[0], g_ent


class _TokenPass:
    """One pass over the loss's valid rows: loss, metrics, log-probs and fp32 gradients."""

    def __init__(self, head: LMHead, lctx: LossContext, hidden, weight, targets, opts: dict):
        self.head, self.lctx, self.cfg = head, lctx, opts["cfg"]
        self.need_ent = opts["need_entropy"]
        self.want_dh, self.want_dw = opts["want_dh"], opts["want_dw"]
        self.t_local = local_targets(targets, lctx.index, head)
        self.h_full = gather_hidden(hidden, head)
        n_rows, dev = lctx.num_rows, hidden.device
        self.logp = torch.zeros(n_rows, device=dev)
        self.ent = torch.zeros(n_rows, device=dev) if self.need_ent else None
        self.loss = torch.zeros((), device=dev)
        self.metrics = [lctx.metrics]
        self.dh_full = None
        if self.want_dh:
            self.dh_full = self.h_full.new_zeros(self.h_full.shape, dtype=torch.float32)
        self.dw_acc = weight_grad_accumulator(weight, direct=False) if self.want_dw else None

    def run(self) -> None:
        n_rows, step = self.lctx.num_rows, self.head.chunk_size
        for start in range(0, n_rows, step):
            self._chunk(start, min(start + step, n_rows))

    def _chunk(self, start: int, stop: int) -> None:
        head, rows, idx = self.head, slice(start, stop), self.lctx.index
        h = take_rows(self.h_full, idx, start, stop)
        logits = head.logits(h)
        m, s, zt, b = head.stats(logits, self.t_local[rows], self.need_ent)
        lse, zt, pz = combine_row_stats(m, s, zt, b, head.tp)
        self.logp[rows] = zt - lse
        ent = None
        if self.ent is not None:
            ent = self.ent[rows] = lse - pz
        part, metrics, g_lp, g_ent = _chunk_objective(
            self.cfg, self.lctx.rows(rows), self.logp[rows], ent
        )
        self.loss += part
        self.metrics.append(metrics)
        if not (self.want_dh or self.want_dw):
            return
        pz = pz if g_ent is not None else None
        dlogits = head.dlogits(logits, self.t_local[rows], lse, g_lp, g_ent, pz)
        del logits
        dh = head.grad_gemms(dlogits, h, self.dw_acc, self.want_dh)
        if dh is not None:
            self.dh_full.index_copy_(0, idx[rows], dh)


class _FusedTokenGRPO(torch.autograd.Function):
    """Forward does the whole loss + gradient pass; backward scales by grad_output."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, head: LMHead, lctx: LossContext, opts: dict):
        run = _TokenPass(head, lctx, hidden, weight, targets, opts)
        run.run()
        dh_local = reduce_hidden_grad(run.dh_full, head) if run.want_dh else None
        ctx.save_for_backward(dh_local, run.dw_acc)
        ctx.weight, ctx.hidden_dtype = weight, hidden.dtype
        opts["metrics"] = merge_metrics(run.metrics)
        total = targets.shape[0]
        logp = scatter_rows(run.logp, lctx.index, total)
        ent = logp.new_zeros(0) if run.ent is None else scatter_rows(run.ent, lctx.index, total)
        ctx.mark_non_differentiable(logp, ent)
        return run.loss, logp, ent

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_ent):
        dh_local, dw_acc = ctx.saved_tensors
        dh = dw = None
        if dh_local is not None:
            dh = (dh_local * grad_loss).to(ctx.hidden_dtype)
        if dw_acc is not None:
            dw = finish_weight_grad(ctx.weight, dw_acc.mul_(grad_loss))
        return dh, dw, None, None, None, None


def fused_grpo_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    cfg: GRPOLossConfig,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    ref_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    denominator: float | Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    impl: str = "auto",
    return_entropy: bool = False,
) -> tuple[Tensor, MetricDict, Tensor] | tuple[Tensor, MetricDict, Tensor, Tensor]:
    """``grpo_loss`` of the log-probs of ``hidden @ weight^T / temperature`` without a second
    LM-head pass: same loss, gradients and metrics as ``vocab_parallel_logprobs`` + ``grpo_loss``.

    hidden / weight / targets / TP arguments: as :func:`vocab_parallel_logprobs`; the loss
    arguments (all [T], ``cu_seqlens`` [S+1]): as :func:`megatron_grpo.loss.grpo_loss`.
    Entropy is computed only when ``cfg.entropy_coef != 0`` or ``return_entropy``.

    Returns:
        ``(loss, metrics, logprobs[, entropy])``: the float32 scalar loss (differentiable
        w.r.t. hidden and weight), the loss metrics, and detached float32 [T] log-probs (and
        entropy) of the loss's rows (0 elsewhere), identical on every TP rank.
    """
    if not isinstance(cfg, GRPOLossConfig):
        raise TypeError(f"cfg must be a GRPOLossConfig, got {type(cfg).__name__}")
    need_ent = return_entropy or cfg.entropy_coef != 0
    loss_args = dict(
        old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask,
        cu_seqlens=cu_seqlens, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
        denominator=denominator, cp_group=cp_group,
    )  # fmt: skip
    op_args = dict(
        tp_group=tp_group, sequence_parallel=sequence_parallel, temperature=temperature,
        vocab_size=vocab_size, chunk_size=chunk_size, impl=impl,
    )  # fmt: skip
    if cfg.ratio_level == "sequence":
        return _sequence_level(
            hidden, weight, targets, cfg, need_ent, return_entropy, loss_args, op_args
        )
    head_args = {k: v for k, v in op_args.items() if k != "tp_group"}
    head = build_lm_head(hidden, weight, targets, tp=TPInfo.of(tp_group), **head_args)
    lctx = build_context(cfg, **loss_args)
    check_targets(targets, lctx.index, head.vocab_size)
    grad_on = torch.is_grad_enabled()
    opts = dict(
        cfg=cfg,
        need_entropy=need_ent,
        want_dh=grad_on and hidden.requires_grad,
        want_dw=grad_on and weight.requires_grad,
    )
    loss, logp, ent = _FusedTokenGRPO.apply(hidden, weight, targets, head, lctx, opts)
    return (loss, opts["metrics"], logp, ent) if return_entropy else (loss, opts["metrics"], logp)


def _sequence_level(hidden, weight, targets, cfg, need_ent, return_entropy, loss_args, op_args):
    """GSPO: log-probs first (op with recompute), then the loss, then autograd."""
    out = vocab_parallel_logprobs(
        hidden,
        weight,
        targets,
        rows=loss_args["loss_mask"].bool(),
        return_entropy=need_ent,
        **op_args,
    )
    logp, ent = out if need_ent else (out, None)
    loss, metrics = grpo_loss(cfg, logprobs=logp, entropy=ent, **loss_args)
    if return_entropy:
        return loss, metrics, logp.detach(), ent.detach()
    return loss, metrics, logp.detach()
