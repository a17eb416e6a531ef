"""``fused_grpo_loss``: the GRPO loss straight from hidden states and the LM-head shard.

The loss context (``loss.math.build_context``) is built once, then one of two paths runs,
chosen by the call's plan (:func:`megatron_grpo.ops.lm_head.plan.plan_lm_head`; ``path=`` picks one
explicitly, :func:`fused_grpo_loss_plan` shows it); (a) serves ratio_level "token" only:

(a) single pass, 3 GEMMs, no recompute (:mod:`megatron_grpo.ops.lm_head.single_pass`): per full-width
    row chunk [C, V_local] of the loss's rows: logits (bf16 shifted logits and block stats from
    the fused-epilogue GEMM, or fp32 logits), row stats, TP combine of those rows,
    logp / entropy, ``loss.math.objective`` on the chunk under autograd (metrics merged),
    d logits in place, ``dh_chunk = dlogits @ W`` (fp32, TP-reduced at the end) and
    ``d_weight += dlogits^T @ h`` into an fp32 ``main_grad`` when there is one, else into the
    plan's accumulator (a bf16 weight's gradient + int8 residual, or an fp32 buffer). Backward
    only scales by grad_output (see "grad_output" below).
(b) tiled recompute, 4 GEMMs: the op's tiled stats pass over the loss rows
    (:func:`ops.lm_head.passes.forward_stats`), the objective of all rows at once (d loss / d logp,
    d loss / d entropy by autograd: ``single_pass.objective_grads``), and in backward the op's
    recompute pass (:func:`ops.lm_head.passes.backward_grads`) with those row gradients; one logits
    tile, d_weight straight into an fp32 ``main_grad``.

The rule (``ops.lm_head.plan``). (a) keeps complete rows of one chunk (a row's loss needs its
full-vocabulary statistics). With the fused-epilogue GEMM (``kernels.head_gemm``, the default
with the triton kernels) a chunk is bf16 *shifted* logits ``z - m_block`` plus fp32 block
statistics, so the 1 GiB default budget holds C = 3200 rows of a 152k shard; with the
"separate" GEMM it is fp32 logits (C = 384 at the 256 MiB tile). (a) reads + writes the fp32
[V_local, H] d_weight once per chunk, ``8 V_local H`` bytes against ``6 C V_local H`` GEMM flops,
so it wins from a few thousand rows: the automatic threshold is
``ops.lm_head.plan.SINGLE_PASS_MIN_ROWS["fused_epilogue"] = 1024`` rows. (a) queues every chunk
without a host sync (its one finiteness check runs before the last chunk's gradient GEMMs).
Without an fp32 ``main_grad`` (bf16 weight) (a) sums d_weight in the bf16 gradient itself plus
an int8 [V_local, H] residual (``kernels.split_accumulator``: fp32-grade sums, the gradient
rounded once), each chunk reading + writing the pair in its d_weight GEMM's epilogue; that pays
per chunk, so the split accumulator runs only for chunks of at least
``ops.lm_head.plan.SPLIT_MIN_ROWS = 4096`` rows (a budget of ~2.5 GiB and up); at the 1 GiB
default (b) runs. A bf16 ``main_grad`` needs an fp32 buffer instead. The "separate" GEMM keeps
``SINGLE_PASS_MIN_ROWS["separate"] = 4096`` rows of fp32 logits. Without gradients (no_grad /
frozen) (b)'s stats pass runs. A larger ``memory_budget`` enlarges chunks and tiles. The
measurements behind these thresholds: docs/benchmarks.md ("The fused path's thresholds").

grad_output in (a): d_weight lands in an fp32 ``main_grad`` during the forward, for a
grad_output of 1 (Megatron's bf16 per-token-loss step: ``loss_scale * loss`` with scale 1). A
backward with grad_output s != 1 (fp16 loss scaling, a scaled loss) adds ``(s - 1) d_weight``
by a recompute pass (one host sync decides), so the result is exact for any s. A forward with
gradients enabled whose loss is never backpropagated leaves d_weight in ``main_grad``: evaluate
under ``torch.no_grad()``. A second backward (``retain_graph``) recomputes like (b).

ratio_level "sequence" (GSPO): a token's ratio depends on every token of its sequence (across
CP ranks too), so no gradient exists before all of a sequence's log-probs do. (b) has them: its
objective sees every loss row of every sequence, its autograd runs through the differentiable
CP all-reduce of the sequence sums (``loss.segments``), and its backward needs only the row
gradients. So the plan runs (b) (``path=None`` / "fused" / "fused_tiled"); an explicit
"fused_single_pass" raises (its objective runs chunk by chunk, on incomplete sequences).
``path="op"`` (``vocab_parallel_logprobs``, then ``grpo_loss``, autograd through the op) runs
either ratio.

``chunk_size`` means rows per logits tile on every path: full-width [chunk_size, V_local] in (a)
(chosen only when that fits the tile budget), [chunk_size, Vc] tiles in (b). Prompt tokens
(loss_mask False) never reach the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.loss import GRPOLossConfig, LossInputs, grpo_loss
from megatron_grpo.loss.math import LossContext, build_context, raise_on_nonfinite
from megatron_grpo.loss.metrics import MetricDict, merge_metrics
from megatron_grpo.ops.lm_head.comm import TPInfo
from megatron_grpo.ops.lm_head.head import LMHead, build_lm_head, head_shard, targets_check
from megatron_grpo.ops.lm_head.logprobs import logprobs_plan, vocab_parallel_logprobs
from megatron_grpo.ops.lm_head.options import LMHeadOptions
from megatron_grpo.ops.lm_head.passes import (
    backward_grads,
    forward_stats,
    gather_hidden,
    local_targets,
    scatter_rows,
)
from megatron_grpo.ops.lm_head.plan import (
    HeadRequest,
    HeadShape,
    LMHeadPlan,
    plan_lm_head,
    resolve_request,
)
from megatron_grpo.ops.lm_head.single_pass import (
    ForwardWeightGrad,
    TokenSinglePass,
    objective_grads,
)
from megatron_grpo.ops.lm_head.stats import RowGrads
from megatron_grpo.ops.lm_head.weight_grad import WeightGradSink, main_grad_done

_NO_GRADS = (None,) * 6


@dataclass(frozen=True)
class _LossCall:
    """What the autograd Functions need besides tensors (read, never written)."""

    cfg: GRPOLossConfig
    need_entropy: bool
    want_dh: bool
    want_dw: bool


def _recompute(ctx, factor: Tensor, want_dh: bool, want_dw: bool):
    """(d_hidden, autograd's d_weight) of ``factor`` x the saved loss gradients, by the op's
    tiled recompute pass (d_weight into main_grad / the gradient, as the op does)."""
    hidden, weight, idx, t_local, lse, g_lp, g_ent, pz = ctx.saved_tensors
    grads = RowGrads(lse, g_lp * factor, None if g_ent is None else g_ent * factor, pz)
    head: LMHead = ctx.head
    sink = WeightGradSink(weight, head.n_valid, head.plan.weight_grad) if want_dw else None
    dh = backward_grads(head, hidden, idx, t_local, grads, sink, want_dh)
    return dh, None if sink is None else sink.finish()


def _outputs(ctx, logp: Tensor, ent: Tensor | None, idx: Tensor | None, total: int):
    """[N] log-probs (entropy) -> non-differentiable [T] outputs (entropy: [0] when absent)."""
    logp_out = scatter_rows(logp, idx, total)
    ent_out = logp.new_zeros(0) if ent is None else scatter_rows(ent, idx, total)
    ctx.mark_non_differentiable(logp_out, ent_out)
    return logp_out, ent_out


class _TiledTokenGRPO(torch.autograd.Function):
    """Path "fused_tiled" (either ratio level: the loss sees all rows at once). Forward: stats
    pass + loss + d loss / d logp -> (loss, logp [T], entropy [T] or [0], metrics); backward:
    the recompute pass."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, head: LMHead, lctx: LossContext, call: _LossCall):
        total = targets.shape[0]
        idx = None if lctx.num_rows == total else lctx.index  # sorted: all rows = arange
        t_local = local_targets(targets, idx, head)
        need_ent = call.need_entropy
        st = forward_stats(head, gather_hidden(hidden, head), idx, t_local, need_ent)
        ent = st.entropy if need_ent else None
        want_grad = call.want_dh or call.want_dw
        loss, metrics, g_lp, g_ent = objective_grads(call.cfg, lctx, st.logp, ent, want_grad)
        raise_on_nonfinite(call.cfg, st.logp, ent)  # the host sync once the loss is queued
        ctx.head, ctx.call = head, call
        pz = st.pz if g_ent is not None else None
        ctx.save_for_backward(hidden, weight, idx, t_local, st.lse, g_lp, g_ent, pz)
        out = _outputs(ctx, st.logp, ent, idx, total)
        return loss, *out, merge_metrics([lctx.metrics, metrics])

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_ent, _grad_metrics):
        want_dh, want_dw = ctx.call.want_dh, ctx.call.want_dw
        if grad_loss is None or not (want_dh or want_dw):
            return _NO_GRADS
        dh, dw = _recompute(ctx, grad_loss.float(), want_dh, want_dw)
        return dh, dw, None, None, None, None


class _SinglePassTokenGRPO(torch.autograd.Function):
    """Path "fused_single_pass". Forward: loss and the gradients of grad_output 1 -> (loss,
    logp [T], entropy [T] or [0], metrics); backward: scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, head: LMHead, lctx: LossContext, call: _LossCall):
        total = targets.shape[0]
        idx = None if lctx.num_rows == total else lctx.index
        t_local = local_targets(targets, idx, head)
        dw = ForwardWeightGrad(head) if call.want_dw else None
        run = TokenSinglePass(head, lctx, call.cfg, call.need_entropy)
        res = run.run(gather_hidden(hidden, head), idx, t_local, call.want_dh, dw)
        ctx.head, ctx.call = head, call
        ctx.dh, ctx.dw = res.dh, dw  # consumed (scaled in place) by the first backward
        g = res.rows.grads()
        ctx.save_for_backward(hidden, weight, idx, t_local, g.lse, g.g_logp, g.g_ent, g.pz)
        out = _outputs(ctx, res.rows.logp, res.rows.ent, idx, total)
        return res.loss, *out, merge_metrics(res.metrics)

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_ent, _grad_metrics):
        want_dh, want_dw = ctx.call.want_dh, ctx.call.want_dw
        if grad_loss is None or not (want_dh or want_dw):
            return _NO_GRADS
        scale = grad_loss.float()
        if ctx.dh is None and ctx.dw is None:  # a second backward (retain_graph)
            dh, dw = _recompute(ctx, scale, want_dh, want_dw)
            return dh, dw, None, None, None, None
        dh, acc = ctx.dh, ctx.dw
        ctx.dh = ctx.dw = None
        if dh is not None:
            dh = dh.mul_(scale).to(ctx.saved_tensors[0].dtype)
        dw = None if acc is None else _deliver_weight_grad(ctx, acc, scale)
        return dh, dw, None, None, None, None


def _deliver_weight_grad(ctx, acc: ForwardWeightGrad, scale: Tensor) -> Tensor | None:
    """grad_output ``scale`` applied to the forward's d_weight; what autograd gets for weight."""
    weight = ctx.saved_tensors[1]
    if acc.in_main_grad:  # main_grad already holds 1 x d_weight
        if bool(scale != 1):  # one host sync; the correction also marks main_grad done
            return _recompute(ctx, scale - 1, want_dh=False, want_dw=True)[1]
        return main_grad_done(weight)
    grad = acc.scaled(scale)
    if ctx.head.plan.weight_grad == "add_tiles":  # a low-precision main_grad: rounded once
        weight.main_grad.add_(grad)
        return main_grad_done(weight)
    return grad.to(weight.dtype)  # the gradient itself, or rounded once (write_tiles, "fp32")


def fused_grpo_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    cfg: GRPOLossConfig,
    inputs: LossInputs | None = None,
    *,
    options: LMHeadOptions | None = None,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    return_entropy: bool = False,
    request: HeadRequest | None = None,
    **overrides: object,
) -> tuple[Tensor, MetricDict, Tensor] | tuple[Tensor, MetricDict, Tensor, Tensor]:
    """``grpo_loss`` of the log-probs of ``hidden @ weight^T / temperature``: same loss,
    gradients and metrics as ``vocab_parallel_logprobs`` + ``grpo_loss``, with the loss and its
    log-prob gradients computed inside the op (see the module docstring).

    hidden / weight / targets / ``tp_group`` / ``sequence_parallel``: as
    :func:`vocab_parallel_logprobs`; ``inputs``: the loss inputs (:class:`LossInputs`, all
    [T], ``cu_seqlens`` [S+1]; as :func:`megatron_grpo.loss.grpo_loss`; ``old_logprobs=None``:
    on-policy, the current log-probs detached). ``options``: :class:`LMHeadOptions`; its
    ``path``: None / "fused" = the plan's choice (:mod:`megatron_grpo.ops.lm_head.plan`;
    "fused_tiled" for a sequence ratio), or "fused_tiled", "fused_single_pass" (token ratio
    only), "op" (log-probs, then ``grpo_loss``); ``chunk_size``: rows per logits tile on either
    fused path; ``memory_budget``: bytes, trading memory for speed (None = 1 GiB); ``gemm``:
    how the logits GEMM meets the softmax work (auto = its fused epilogue with the triton
    kernels). ``overrides``: fields of either by keyword, replacing those of ``inputs`` /
    ``options``. Entropy is computed only when ``cfg.entropy_coef != 0`` or
    ``return_entropy``. On the single pass an fp32 ``weight.main_grad`` receives d_weight
    during the forward (module doc); :func:`fused_grpo_loss_plan` returns the plan a call runs.
    ``request``: the path request already resolved (``GRPOStep`` resolves it once); None =
    resolved here, once, from ``options.path`` and ``cfg``.

    Returns:
        ``(loss, metrics, logprobs[, entropy])``: the float32 scalar loss (differentiable
        w.r.t. hidden and weight), the loss metrics, and detached float32 [T] log-probs (and
        entropy) of the loss's rows (0 elsewhere), identical on every TP rank.
    """
    args = _Args.of(cfg, inputs, options, tp_group, sequence_parallel, overrides, request)
    need_ent = return_entropy or cfg.entropy_coef != 0
    if _request(args) == "op":
        return _op_path(hidden, weight, targets, args, need_ent, return_entropy)
    head, lctx = _fused_setup(hidden, weight, targets, args)
    run = _LossCall(cfg, need_ent, *_wants(hidden, weight))
    fn = _SinglePassTokenGRPO if head.plan.path == "fused_single_pass" else _TiledTokenGRPO
    loss, logp, ent, metrics = fn.apply(hidden, weight, targets, head, lctx, run)
    return (loss, metrics, logp, ent) if return_entropy else (loss, metrics, logp)


def fused_grpo_loss_plan(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    cfg: GRPOLossConfig,
    inputs: LossInputs | None = None,
    *,
    options: LMHeadOptions | None = None,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    request: HeadRequest | None = None,
    **overrides: object,
) -> LMHeadPlan:
    """The plan :func:`fused_grpo_loss` runs with the same arguments. Path "op" is the plan of
    its log-prob op."""
    args = _Args.of(cfg, inputs, options, tp_group, sequence_parallel, overrides, request)
    if _request(args) == "fused":
        return _fused_setup(hidden, weight, targets, args)[0].plan
    plan = logprobs_plan(
        hidden,
        weight,
        targets,
        args.options,
        rows=args.inputs.loss_mask.bool(),
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
    )
    return replace(plan, reason=args.request.reason)


@dataclass(frozen=True)
class _Args:
    """One call's loss config, loss inputs, LM-head options and TP placement."""

    cfg: GRPOLossConfig
    inputs: LossInputs
    options: LMHeadOptions
    tp_group: dist.ProcessGroup | None
    sequence_parallel: bool
    request: HeadRequest  # resolved once per call (or per step: GRPOStep's)

    @staticmethod
    def of(
        cfg: GRPOLossConfig,
        inputs: LossInputs | None,
        options: LMHeadOptions | None,
        tp_group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        overrides: dict[str, object],
        request: HeadRequest | None,
    ) -> _Args:
        """The call of the public arguments: keyword ``overrides`` go to the options when they
        name an option, else to the inputs (an unknown name raises TypeError there)."""
        if not isinstance(cfg, GRPOLossConfig):
            raise TypeError(f"cfg must be a GRPOLossConfig, got {type(cfg).__name__}")
        names = LMHeadOptions.field_names()
        opts = LMHeadOptions.of(options, **{k: v for k, v in overrides.items() if k in names})
        rest = {k: v for k, v in overrides.items() if k not in names}
        request = request or resolve_request(opts.path, cfg)
        inputs = LossInputs.of(inputs, **rest)
        return _Args(cfg, inputs, opts, tp_group, sequence_parallel, request)


def _request(args: _Args) -> str:
    """The request the call's path means here: "op", or "fused" (either fused path, the plan's
    to pick); "megatron" is GRPOStep's alone."""
    request = args.request.path
    if request == "megatron":
        raise ValueError("path 'megatron' runs Megatron's output layer: use GRPOStep")
    return "op" if request == "op" else "fused"


def _wants(hidden: Tensor, weight: Tensor) -> tuple[bool, bool]:
    """(d_hidden wanted, d_weight wanted) of a call made now."""
    grad_on = torch.is_grad_enabled()
    return grad_on and hidden.requires_grad, grad_on and weight.requires_grad


def _fused_setup(
    hidden: Tensor, weight: Tensor, targets: Tensor, args: _Args
) -> tuple[LMHead, LossContext]:
    """(the head bound to its plan, the loss context) of a fused args."""
    tp, sp = TPInfo.of(args.tp_group), args.sequence_parallel
    shard = head_shard(hidden, weight, targets, args.options, tp=tp, sequence_parallel=sp)
    # the target check joins the context's checks: one host sync for all of them
    check = partial(targets_check, targets, vocab_size=shard.vocab_size)
    lctx = build_context(args.cfg, args.inputs, row_checks=[check])
    want_dh, want_dw = _wants(hidden, weight)
    shape = HeadShape.of(
        weight, rows=lctx.num_rows, n_valid=shard.n_valid, want_dh=want_dh, want_dw=want_dw
    )
    plan = plan_lm_head(shape, args.options, loss=args.cfg, request=args.request)
    return build_lm_head(weight, shard, plan, args.options, tp=tp, sequence_parallel=sp), lctx


def _op_path(
    hidden: Tensor, weight: Tensor, targets: Tensor, args: _Args, need_ent: bool, ret_ent: bool
):
    """Path "op": log-probs first (op with recompute), then the loss, then autograd."""
    out = vocab_parallel_logprobs(
        hidden,
        weight,
        targets,
        args.options,
        tp_group=args.tp_group,
        sequence_parallel=args.sequence_parallel,
        rows=args.inputs.loss_mask.bool(),
        return_entropy=need_ent,
    )
    logp, ent = out if need_ent else (out, None)
    loss, metrics = grpo_loss(args.cfg, args.inputs, logprobs=logp, entropy=ent)
    if ret_ent:
        return loss, metrics, logp.detach(), ent.detach()
    return loss, metrics, logp.detach()
