"""``fused_grpo_loss``: the GRPO loss straight from hidden states and the LM-head shard.

ratio_level "token": the loss context (``loss.math``) is built once; the forward runs the
op's tiled statistics pass over the loss's valid rows only (:func:`ops.passes.forward_stats`),
evaluates ``loss.math.objective`` on all of them at once under autograd and keeps d loss /
d logp and d loss / d entropy ([N] vectors). The backward scales those by grad_output and runs
the op's recompute pass (:func:`ops.passes.backward_grads`): 4 GEMMs, the op's memory (one
logits tile; d_weight straight into an fp32 ``main_grad``), and no [T]-sized autograd graph.

Why not the 3-GEMM design (logits, d_hidden, d_weight all in the forward, no recompute): the
loss of a row needs its full-vocabulary statistics before any d logits, so a chunk must hold
complete fp32 [C, V_local] rows (0.58 MiB per row at V = 151936), and d_weight must be kept in a
separate fp32 [V_local, H] buffer until grad_output is known (it cannot go into ``main_grad``
early), read and written once per chunk. Measured on one H200 (T = 8192, H = 4096,
V = 151936, bf16; 3-GEMM floor 43.9 ms; "over" = peak memory beyond the gradients):

    3-GEMM, C = 384 (256 MiB chunks)    110.4 ms  2.54x  over 2.44 GiB
    3-GEMM, C = 1024                      62.4 ms  1.42x  over 2.44 GiB
    3-GEMM, C = 2048                      56.8 ms  1.29x  over 2.98 GiB
    this path (tiled, 4 GEMMs)            67.2 ms  1.51x  over 0.38 GiB (also with main_grad)

The 3-GEMM design only gets fast with chunks far beyond the memory target (gradients +
0.5 GiB), so the tiled pass is the one implementation.

ratio_level "sequence" (GSPO): a token's ratio depends on every token of its sequence (across
CP ranks too), so it runs ``vocab_parallel_logprobs`` (rows = loss mask), then ``grpo_loss``,
and autograd through the op.

Prompt tokens (loss_mask False) never reach the LM head in either mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.loss import GRPOLossConfig, grpo_loss
from megatron_grpo.loss.math import LossContext, build_context, objective
from megatron_grpo.loss.metrics import MetricDict, merge_metrics
from megatron_grpo.ops.comm import TPInfo
from megatron_grpo.ops.lm_head import LMHead, RowGrads, build_lm_head, check_targets
from megatron_grpo.ops.logprobs import vocab_parallel_logprobs
from megatron_grpo.ops.passes import (
    backward_grads,
    forward_stats,
    gather_hidden,
    local_targets,
    scatter_rows,
)
from megatron_grpo.ops.weight_grad import WeightGradSink


def _objective_grads(
    cfg: GRPOLossConfig, lctx: LossContext, logp: Tensor, ent: Tensor | None, want_grad: bool
) -> tuple[Tensor, MetricDict, Tensor | None, Tensor | None]:
    """Objective of all rows and, if wanted, its gradients w.r.t. logp / entropy ([N] each)."""
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


class _FusedTokenGRPO(torch.autograd.Function):
    """Forward: stats pass + loss + d loss / d logp; backward: the recompute pass."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, head: LMHead, lctx: LossContext, opts: dict):
        total = targets.shape[0]
        idx = None if lctx.num_rows == total else lctx.index  # sorted: all rows = arange
        t_local = local_targets(targets, idx, head)
        need_ent = opts["need_entropy"]
        lse, zt, pz = forward_stats(head, gather_hidden(hidden, head), idx, t_local, need_ent)
        logp = zt - lse
        ent = lse - pz if need_ent else None
        want_grad = opts["want_dh"] or opts["want_dw"]
        loss, metrics, g_lp, g_ent = _objective_grads(opts["cfg"], lctx, logp, ent, want_grad)
        opts["metrics"] = merge_metrics([lctx.metrics, metrics])
        ctx.head, ctx.opts = head, opts
        pz = pz if g_ent is not None else None
        ctx.save_for_backward(hidden, weight, idx, t_local, lse, pz, g_lp, g_ent)
        logp_out = scatter_rows(logp, idx, total)
        ent_out = logp.new_zeros(0) if ent is None else scatter_rows(ent, idx, total)
        ctx.mark_non_differentiable(logp_out, ent_out)
        return loss, logp_out, ent_out

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_ent):
        hidden, weight, idx, t_local, lse, pz, g_lp, g_ent = ctx.saved_tensors
        want_dh, want_dw = ctx.opts["want_dh"], ctx.opts["want_dw"]
        if grad_loss is None or not (want_dh or want_dw):
            return None, None, None, None, None, None
        scale = grad_loss.float()
        grads = RowGrads(lse, g_lp * scale, None if g_ent is None else g_ent * scale, pz)
        sink = WeightGradSink(weight, ctx.head.n_valid) if want_dw else None
        dh = backward_grads(ctx.head, hidden, idx, t_local, grads, sink, want_dh)
        return dh, None if sink is None else sink.finish(), None, None, None, None


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
    """``grpo_loss`` of the log-probs of ``hidden @ weight^T / temperature``: same loss,
    gradients and metrics as ``vocab_parallel_logprobs`` + ``grpo_loss``, with the loss and its
    log-prob gradients computed inside the op (see the module docstring).

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
