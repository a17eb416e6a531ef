"""Sequence-parallel linear layers whose TP collective runs inside the GEMM loop (ring
collective-matmul): the communication of one sequence chunk travels while another chunk's GEMM
runs, so only one chunk's transfer is left on the critical path instead of the whole collective.

Notation: ``p`` = TP size, ``r`` = this rank in the TP group, ``s`` = sequence length (a multiple
of ``p``: sequence parallelism's own rule), ``s_l = s / p``, ``b`` = micro-batch, ``h`` / ``o``
= in / out features (``h_l = h / p``, ``o_l = o / p``). Chunk ``c`` of a ``[s, ...]`` tensor is
rows ``c * s_l : (c + 1) * s_l``, the rows rank ``c`` holds under sequence parallelism.

* :func:`allgather_linear` (column parallel): ``x_local [s_l, b, h]``, ``weight [o_l, h]``,
  ``bias [o_l] | None`` -> ``[s, b, o_l] = all_gather(x_local) @ weight.T + bias``. Forward:
  ``p`` GEMMs, one per chunk, while the next chunk arrives from the previous rank (a ring of
  ``p - 1`` async send/recv pairs). Backward: ``d_x`` (``[s_l, b, h]``) is reduce-scattered by a
  ring of partial sums, each rank's GEMM for the next chunk running while the partial sum
  travels; the input is gathered again in the same ring steps (not saved: the gathered ``[s, b,
  h]`` would stay alive per layer until backward, ``p`` times megatron-core's saved input) and
  ``d_weight`` is one GEMM over the gathered input, as megatron-core computes it.
* :func:`linear_reduce_scatter` (row parallel): ``x [s, b, h_l]``, ``weight [o, h_l]`` ->
  ``[s_l, b, o] = reduce_scatter(x @ weight.T)``: a ring of partial sums over the ``p`` chunk
  GEMMs. Backward: ``d_y`` is all-gathered by the ring while each arrived chunk's ``d_x`` GEMM
  runs; ``d_weight`` is one GEMM over the gathered ``d_y``. The bias is the caller's (it is
  added after the reduce-scatter, replicated).

Partial sums travel in the input dtype, as NCCL's reduce-scatter sums; the order of the ``p``
terms differs from the collective's, so results equal megatron-core's up to rounding. The
transfers are ``torch.distributed.batch_isend_irecv`` on the TP group (NCCL runs them on its
own stream, so the GEMMs overlap them; gloo on CPU runs the same code for the tests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Ring", "allgather_linear", "linear_reduce_scatter"]


class Ring:
    """The TP group as a ring: each step this rank sends to the next rank and receives from
    the previous one (global ranks for the P2P ops)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, sends: list[Tensor], recvs: list[Tensor]) -> list:
        """Start sending ``sends`` to the next rank and receiving ``recvs`` (same order, same
        shapes) from the previous one; the works to wait on. Distinct tags keep the pairs
        apart on backends that match by tag (gloo)."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, i) for i, t in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, i) for i, t in enumerate(recvs)]
        return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    """Wait on each work once and forget them (a gloo work waited on twice blocks)."""
    for w in works:
        w.wait()
    works.clear()


def _chunk(t: Tensor, c: int, size: int) -> Tensor:
    """Chunk ``c`` of ``size`` along dim 0 (a contiguous view of a contiguous ``t``)."""
    n = t.shape[0] // size
    return t[c * n : (c + 1) * n]


def check_sequence(x: Tensor, size: int, what: str) -> None:
    """``x [s, ...]``: ``s`` a multiple of the TP ``size`` (sequence parallelism's rule), else an
    error naming ``what`` (shared with :mod:`.symm_linear`)."""
    if x.shape[0] % size:
        raise ValueError(
            f"{what}: sequence length {x.shape[0]} is not a multiple of the TP size {size} "
            "(sequence parallelism splits the sequence evenly)"
        )


def _gather_matmul(x_local: Tensor, weight: Tensor, ring: Ring) -> Tensor:
    """``[s_l, b, h] x [o_l, h] -> [s, b, o_l]``: chunk ``(r - k) % p`` at step ``k``, the next
    chunk arriving from the previous rank meanwhile."""
    p, r = ring.size, ring.rank
    out = x_local.new_empty((p * x_local.shape[0], *x_local.shape[1:-1], weight.shape[0]))
    cur, works = x_local, []
    for k in range(p):
        nxt = torch.empty_like(x_local) if k < p - 1 else None
        if nxt is not None:
            works = ring.exchange([cur], [nxt])
        torch.matmul(cur, weight.t(), out=_chunk(out, (r - k) % p, p))
        _wait(works)
        cur = nxt
    return out


def _matmul_reduce_scatter(x: Tensor, weight: Tensor, ring: Ring, gathered: list | None) -> Tensor:
    """``[s, b, k] x [k, n]^T`` reduce-scattered over the ring: ``[s_l, b, n]`` for chunk ``r``.

    Step ``k`` computes this rank's term of chunk ``(r - 1 - k) % p`` while the partial sum of
    step ``k - 1`` travels, then adds the received partial sum and passes it on (the last step's
    chunk is ``r``). ``gathered``: ``[full [s, ...], local [s_l, ...]]`` to all-gather in the
    same steps (the input of the column layer's backward), or None.
    """
    p, r = ring.size, ring.rank
    part, recv, works = None, None, []
    for k in range(p):
        part = torch.matmul(_chunk(x, (r - 1 - k) % p, p), weight.t())
        _wait(works)
        if k > 0:
            part += recv
        if k == p - 1:
            break
        recv = torch.empty_like(part)
        sends, recvs = [part], [recv]
        if gathered is not None:  # send the chunk held, receive the one before it
            sends.append(_chunk(gathered[0], (r - k) % p, p))
            recvs.append(_chunk(gathered[0], (r - 1 - k) % p, p))
        works = ring.exchange(sends, recvs)
    return part


def _gather_dgrad(d_y_local: Tensor, weight: Tensor, ring: Ring, keep: bool):
    """The row layer's backward ring: ``d_y`` all-gathered (``[s_l, b, o] -> [s, b, o]``, kept
    when ``keep`` for the weight gradient) while each held chunk's ``d_x = d_y @ weight`` runs.
    Returns ``(d_x [s, b, h_l], d_y_full or None)``."""
    p, r = ring.size, ring.rank
    s_l = d_y_local.shape[0]
    d_x = d_y_local.new_empty((p * s_l, *d_y_local.shape[1:-1], weight.shape[1]))
    full = d_y_local.new_empty((p * s_l, *d_y_local.shape[1:])) if keep else None
    if full is not None:
        _chunk(full, r, p).copy_(d_y_local)
    cur, works = d_y_local, []
    for k in range(p):
        nxt = None
        if k < p - 1:
            c = (r - 1 - k) % p
            nxt = _chunk(full, c, p) if full is not None else torch.empty_like(d_y_local)
            works = ring.exchange([cur], [nxt])
        torch.matmul(cur, weight, out=_chunk(d_x, (r - k) % p, p))
        _wait(works)
        cur = nxt
    return d_x, full


def weight_grad(d_y: Tensor, x: Tensor) -> Tensor:
    """``d_y [..., n]``, ``x [..., k]`` -> ``[n, k]``: one GEMM over every row (shared with
    :mod:`.symm_linear`)."""
    return d_y.reshape(-1, d_y.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _AllGatherLinear(torch.autograd.Function):
    """See :func:`allgather_linear`."""

    @staticmethod
    def forward(ctx, x_local, weight, bias, ring: Ring):
        ctx.save_for_backward(x_local, weight)
        ctx.ring, ctx.has_bias = ring, bias is not None
        out = _gather_matmul(x_local, weight, ring)
        return out if bias is None else out.add_(bias)

    @staticmethod
    def backward(ctx, d_out):
        x_local, weight = ctx.saved_tensors
        ring, d_out = ctx.ring, d_out.contiguous()
        need_w = ctx.needs_input_grad[1]
        gathered = None
        if need_w:  # the input again, in the reduce-scatter's steps
            full = x_local.new_empty((ring.size * x_local.shape[0], *x_local.shape[1:]))
            _chunk(full, ring.rank, ring.size).copy_(x_local)
            gathered = [full]
        # d_x = reduce_scatter(d_out @ weight): weight.t() of [h, o_l] is weight's transpose
        d_x = _matmul_reduce_scatter(d_out, weight.t(), ring, gathered)
        d_w = weight_grad(d_out, gathered[0]) if need_w else None
        d_b = d_out.reshape(-1, d_out.shape[-1]).sum(0) if ctx.has_bias else None
        return d_x, d_w, d_b, None


class _LinearReduceScatter(torch.autograd.Function):
    """See :func:`linear_reduce_scatter`."""

    @staticmethod
    def forward(ctx, x, weight, ring: Ring):
        ctx.save_for_backward(x, weight)
        ctx.ring = ring
        return _matmul_reduce_scatter(x, weight, ring, None)

    @staticmethod
    def backward(ctx, d_out):
        x, weight = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1]
        d_x, d_y = _gather_dgrad(d_out.contiguous(), weight, ctx.ring, keep=need_w)
        d_w = weight_grad(d_y, x) if need_w else None
        return d_x, d_w, None


def allgather_linear(
    x_local: Tensor, weight: Tensor, bias: Tensor | None, group: dist.ProcessGroup | Ring
) -> Tensor:
    """``all_gather(x_local) @ weight.T + bias`` over ``group`` (sequence-parallel column layer).

    Args:
        x_local: ``[s_l, b, h]`` this rank's sequence chunk.
        weight: ``[o_l, h]`` this rank's output rows.
        bias: ``[o_l]`` or None.
        group: the TP group (or its :class:`Ring`, built once by a layer).
    Returns:
        ``[s, b, o_l]``; backward gives ``d_x_local [s_l, b, h]`` reduce-scattered.
    """
    ring = group if isinstance(group, Ring) else Ring(group)
    return _AllGatherLinear.apply(x_local.contiguous(), weight, bias, ring)


def linear_reduce_scatter(x: Tensor, weight: Tensor, group: dist.ProcessGroup | Ring) -> Tensor:
    """``reduce_scatter(x @ weight.T)`` over ``group`` (sequence-parallel row layer, no bias).

    Args:
        x: ``[s, b, h_l]`` the whole sequence, this rank's input features.
        weight: ``[o, h_l]`` this rank's input columns.
        group: the TP group (or its :class:`Ring`).
    Returns:
        ``[s_l, b, o]`` this rank's sequence chunk of the sum over the TP ranks.
    """
    ring = group if isinstance(group, Ring) else Ring(group)
    check_sequence(x, ring.size, "linear_reduce_scatter input")
    return _LinearReduceScatter.apply(x.contiguous(), weight, ring)
