"""``vocab_parallel_logprobs``: per-token log-probs (and entropy) from hidden states and a
vocab-parallel LM-head shard, in 2D tiles, without materializing [T, V] logits.

Forward: per [R, Vc] tile fp32 logits ``h @ W^T`` -> tile row stats (kernel seam) -> merged
over tiles -> one TP combine over all active rows (all-reduce MAX, then one all-reduce SUM).
Only [R]-sized stats are saved. Backward recomputes each tile's logits, turns them into d logits
(kernel seam) and runs the two gradient GEMMs with fp32 accumulation (see
:mod:`megatron_grpo.ops.lm_head.passes`); d_hidden is reduce-scattered (sequence parallel) or
all-reduced (replicated hidden) across TP in fp32. Tiles, kernels and loop order are the
call's :class:`~megatron_grpo.ops.lm_head.plan.LMHeadPlan` (path "op"; :func:`logprobs_plan`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.ops.lm_head.comm import TPInfo
from megatron_grpo.ops.lm_head.head import LMHead, build_lm_head, head_shard, select_rows
from megatron_grpo.ops.lm_head.options import LMHeadOptions
from megatron_grpo.ops.lm_head.passes import (
    backward_grads,
    forward_stats,
    gather_hidden,
    local_targets,
    scatter_rows,
)
from megatron_grpo.ops.lm_head.plan import OP_REQUEST, HeadShape, LMHeadPlan, plan_lm_head
from megatron_grpo.ops.lm_head.stats import RowGrads
from megatron_grpo.ops.lm_head.weight_grad import WeightGradSink


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, idx, head: LMHead, return_entropy: bool):
        ctx.set_materialize_grads(False)
        t_local = local_targets(targets, idx, head)
        st = forward_stats(head, gather_hidden(hidden, head), idx, t_local, return_entropy)
        total = targets.shape[0]
        logp = scatter_rows(st.logp, idx, total)
        ctx.head = head
        ctx.save_for_backward(hidden, weight, idx, t_local, st.lse, st.pz)
        if not return_entropy:
            return logp
        return logp, scatter_rows(st.entropy, idx, total)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, idx, t_local, lse, pz = ctx.saved_tensors
        want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_entropy is None) or not (want_dh or want_dw):
            return None, None, None, None, None, None
        g_ent = None if grad_entropy is None else _active(grad_entropy, idx, lse)
        grads = RowGrads(lse, _active(grad_logp, idx, lse), g_ent, None if g_ent is None else pz)
        mode = ctx.head.plan.weight_grad
        sink = WeightGradSink(weight, ctx.head.n_valid, mode) if want_dw else None
        dh = backward_grads(ctx.head, hidden, idx, t_local, grads, sink, want_dh)
        return dh, None if sink is None else sink.finish(), None, None, None, None


def _active(grad: Tensor | None, idx: Tensor | None, like: Tensor) -> Tensor:
    """[T] upstream gradient -> fp32 [R] of the active rows (zeros when None)."""
    if grad is None:
        return torch.zeros_like(like)
    grad = grad if idx is None else grad[idx]
    return grad.float().contiguous()


def vocab_parallel_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    options: LMHeadOptions | None = None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    rows: Tensor | None = None,
    return_entropy: bool = False,
    **overrides: object,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs ``log softmax(h W^T / temperature)[target]`` over a TP-sharded vocabulary.

    Args:
        hidden: [T_local, H] (T_local = T / TP with ``sequence_parallel``, else T on every rank).
        weight: [V_local, H], this rank's rows ``[rank * V_local, (rank + 1) * V_local)`` of the
            padded vocabulary.
        targets: [T] global token ids (identical on all TP ranks).
        options: how the op runs (:class:`~megatron_grpo.ops.lm_head.options.LMHeadOptions`:
            ``temperature`` divides the logits; ``vocab_size``, the real vocabulary, default
            V_local * TP: padded rows ``>= vocab_size`` never contribute; ``chunk_size``: rows
            per fp32 logits tile, None = automatic; ``impl``: "torch", "triton" or "auto"
            (triton on CUDA when it imports); ``memory_budget``: bytes of the LM head's working
            set, None = 1 GiB, see :mod:`ops.lm_head.plan`; ``gemm``: "auto", "fused_epilogue" or
            "separate"; its ``path`` is ignored: the op is path "op"). Its fields may also be
            given by keyword (``overrides``), replacing those of ``options``.
        tp_group: the tensor-parallel group; None means no TP (never the default group).
        sequence_parallel: all-gather hidden over TP in forward, reduce-scatter d_hidden in
            backward; otherwise d_hidden is all-reduced over TP.
        rows: optional bool [T]: only these rows go through the LM head; other positions
            return 0 with no gradient and may hold any target (e.g. -100).
        return_entropy: also return the full-distribution entropy (differentiable).
    Returns:
        logp float32 [T] (and entropy float32 [T]), identical on every TP rank. The weight
        gradient goes to ``weight.main_grad`` when it exists, else to ``weight.grad``.
    """
    opts = LMHeadOptions.of(options, **overrides)
    head, idx = _prepare(hidden, weight, targets, opts, rows, tp_group, sequence_parallel)
    return _VocabParallelLogprobs.apply(hidden, weight, targets, idx, head, return_entropy)


def logprobs_plan(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    options: LMHeadOptions | None = None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    rows: Tensor | None = None,
    **overrides: object,
) -> LMHeadPlan:
    """The plan :func:`vocab_parallel_logprobs` runs with these arguments (validated alike)."""
    opts = LMHeadOptions.of(options, **overrides)
    return _prepare(hidden, weight, targets, opts, rows, tp_group, sequence_parallel)[0].plan


def _prepare(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    options: LMHeadOptions,
    rows: Tensor | None,
    tp_group: dist.ProcessGroup | None,
    sequence_parallel: bool,
) -> tuple[LMHead, Tensor | None]:
    """The validated head bound to its plan, and the active rows' indices (None = all). The
    op runs path "op" whatever ``options.path`` requests (that is a loss call's request)."""
    tp = TPInfo.of(tp_group)
    shard = head_shard(hidden, weight, targets, options, tp=tp, sequence_parallel=sequence_parallel)
    idx = select_rows(rows, targets, shard.vocab_size)
    grad_on = torch.is_grad_enabled()
    shape = HeadShape.of(
        weight,
        rows=targets.shape[0] if idx is None else idx.numel(),
        n_valid=shard.n_valid,
        want_dh=grad_on and hidden.requires_grad,
        want_dw=grad_on and weight.requires_grad,
    )
    plan = plan_lm_head(shape, options, request=OP_REQUEST)  # the op: path "op", whatever asked
    head = build_lm_head(weight, shard, plan, options, tp=tp, sequence_parallel=sequence_parallel)
    return head, idx
