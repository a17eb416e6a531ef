"""``vocab_parallel_logprobs``: per-token log-probs (and entropy) from hidden states and a
vocab-parallel LM-head shard, chunked over tokens, without materializing [T, V] logits.

Forward: per row-chunk fp32 logits ``h @ W^T`` -> local row stats (kernel seam) -> one TP
combine over all active rows (all-reduce MAX, then one all-reduce SUM). Only [R]-sized stats are
saved. Backward recomputes each chunk's logits, turns them into d logits (kernel seam) and runs
the two gradient GEMMs; d_hidden is accumulated in fp32 and reduce-scattered (sequence parallel)
or all-reduced (replicated hidden) across TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.ops.comm import (
    TPInfo,
    all_gather_rows,
    all_reduce_sum_,
    combine_row_stats,
    reduce_scatter_rows,
)
from megatron_grpo.ops.lm_head import LMHead, build_lm_head, select_rows, take_rows
from megatron_grpo.ops.weight_grad import finish_weight_grad, weight_grad_accumulator


def gather_hidden(hidden: Tensor, head: LMHead) -> Tensor:
    """[T_local, H] -> [T, H] under sequence parallelism (identity otherwise)."""
    return all_gather_rows(hidden, head.tp) if head.sequence_parallel else hidden


def reduce_hidden_grad(dh_full: Tensor, head: LMHead) -> Tensor:
    """Sums the fp32 [T, H] per-shard d_hidden over TP: [T_local, H] with SP, else [T, H]."""
    if head.sequence_parallel:
        return reduce_scatter_rows(dh_full, head.tp)
    return all_reduce_sum_(dh_full, head.tp)


def scatter_rows(values: Tensor, idx: Tensor | None, total: int) -> Tensor:
    """[R] values of the active rows -> [T] float32 with zeros elsewhere."""
    if idx is None:
        return values
    out = values.new_zeros(total)
    return out.index_copy_(0, idx, values)


def local_targets(targets: Tensor, idx: Tensor | None, head: LMHead) -> Tensor:
    """[R] int64 targets of the active rows relative to this shard's first vocab id."""
    sel = targets if idx is None else targets[idx]
    return sel.long() - head.vocab_start


def forward_stats(
    head: LMHead, h_full: Tensor, idx: Tensor | None, t_local: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Global (lse, zt, pz) [R] of the active rows; one chunk of logits alive at a time."""
    n_rows = t_local.shape[0]
    stats = torch.empty((4 if with_entropy else 3, n_rows), device=h_full.device)
    for start in range(0, n_rows, head.chunk_size):
        stop = min(start + head.chunk_size, n_rows)
        logits = head.logits(take_rows(h_full, idx, start, stop))
        for i, value in enumerate(head.stats(logits, t_local[start:stop], with_entropy)):
            if value is not None:
                stats[i, start:stop] = value
        del logits
    return combine_row_stats(
        stats[0], stats[1], stats[2], stats[3] if with_entropy else None, head.tp
    )


def backward_grads(
    head: LMHead,
    hidden: Tensor,
    idx: Tensor | None,
    t_local: Tensor,
    lse: Tensor,
    g_logp: Tensor,
    g_ent: Tensor | None,
    pz: Tensor | None,
    dw_acc: Tensor | None,
    want_dh: bool,
) -> Tensor | None:
    """Recomputes each chunk; ``dw_acc += dW`` and returns the TP-reduced fp32 d_hidden."""
    h_full = gather_hidden(hidden, head)
    dh_full = h_full.new_zeros(h_full.shape, dtype=torch.float32) if want_dh else None
    n_rows = t_local.shape[0]
    for start in range(0, n_rows, head.chunk_size):
        stop = min(start + head.chunk_size, n_rows)
        h = take_rows(h_full, idx, start, stop)
        logits = head.logits(h)
        rows = slice(start, stop)
        dlogits = head.dlogits(
            logits,
            t_local[rows],
            lse[rows],
            g_logp[rows],
            None if g_ent is None else g_ent[rows],
            None if g_ent is None else pz[rows],
        )
        del logits
        dh = head.grad_gemms(dlogits, h, dw_acc, want_dh)
        if dh is not None:
            _put_rows(dh_full, idx, start, stop, dh)
    return reduce_hidden_grad(dh_full, head) if want_dh else None


def _put_rows(dst: Tensor, idx: Tensor | None, start: int, stop: int, src: Tensor) -> None:
    if idx is None:
        dst[start:stop] = src
    else:
        dst.index_copy_(0, idx[start:stop], src)


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, idx, head: LMHead, return_entropy: bool):
        ctx.set_materialize_grads(False)
        t_local = local_targets(targets, idx, head)
        lse, zt, pz = forward_stats(head, gather_hidden(hidden, head), idx, t_local, return_entropy)
        total = targets.shape[0]
        logp = scatter_rows(zt - lse, idx, total)
        ctx.head = head
        ctx.save_for_backward(hidden, weight, idx, t_local, lse, pz)
        if not return_entropy:
            return logp
        return logp, scatter_rows(lse - pz, idx, total)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, idx, t_local, lse, pz = ctx.saved_tensors
        head: LMHead = ctx.head
        want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_entropy is None) or not (want_dh or want_dw):
            return None, None, None, None, None, None
        g_logp = _active(grad_logp, idx, lse)
        g_ent = None if grad_entropy is None else _active(grad_entropy, idx, lse)
        dw_acc = weight_grad_accumulator(weight, direct=True) if want_dw else None
        dh = backward_grads(head, hidden, idx, t_local, lse, g_logp, g_ent, pz, dw_acc, want_dh)
        dw = finish_weight_grad(weight, dw_acc) if want_dw else None
        dh = None if dh is None else dh.to(hidden.dtype)
        return dh, dw, None, None, None, None


def _active(grad: Tensor | None, idx: Tensor | None, like: Tensor) -> Tensor:
    """[T] upstream gradient -> fp32 [R] of the active rows (zeros when None)."""
    if grad is None:
        return torch.zeros_like(like)
    grad = grad if idx is None else grad[idx]
    return grad.float()


def vocab_parallel_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    impl: str = "auto",
    rows: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs ``log softmax(h W^T / temperature)[target]`` over a TP-sharded vocabulary.

    Args:
        hidden: [T_local, H] (T_local = T / TP with ``sequence_parallel``, else T on every rank).
        weight: [V_local, H], this rank's rows ``[rank * V_local, (rank + 1) * V_local)`` of the
            padded vocabulary.
        targets: [T] global token ids (identical on all TP ranks).
        tp_group: the tensor-parallel group; None means no TP (never the default group).
        sequence_parallel: all-gather hidden over TP in forward, reduce-scatter d_hidden in
            backward; otherwise d_hidden is all-reduced over TP.
        temperature: logits are divided by it.
        vocab_size: real vocabulary size; padded rows ``>= vocab_size`` never contribute.
            Default: V_local * TP.
        return_entropy: also return the full-distribution entropy (differentiable).
        chunk_size: rows per chunk (bounds the [chunk, V_local] fp32 logits); None = auto.
        impl: "torch", "triton" or "auto" (triton on CUDA when it imports).
        rows: optional bool [T]: only these rows go through the LM head; other positions
            return 0 with no gradient and may hold any target (e.g. -100).
    Returns:
        logp float32 [T] (and entropy float32 [T]), identical on every TP rank. The weight
        gradient goes to ``weight.main_grad`` when it exists, else to ``weight.grad``.
    """
    tp = TPInfo.of(tp_group)
    head = build_lm_head(
        hidden,
        weight,
        targets,
        tp=tp,
        sequence_parallel=sequence_parallel,
        temperature=temperature,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        impl=impl,
    )
    idx = select_rows(rows, targets, head.vocab_size)
    return _VocabParallelLogprobs.apply(hidden, weight, targets, idx, head, return_entropy)
