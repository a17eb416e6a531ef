"""Sequence-parallel linear layers on torch's symmetric-memory collective matmuls: the async-TP
ops that torch.compile's micro-pipeline TP pass emits, called eagerly.

``torch.ops.symm_mem.fused_all_gather_matmul`` splits ``all_gather(A) @ B`` by the TP ranks'
chunks and ``fused_matmul_reduce_scatter`` splits ``reduce_scatter(A @ B)`` the same way: on CUDA
each chunk moves between the GPUs' symmetric buffers over NVLink, by the copy engines, while
another chunk's GEMM runs, so the transfers take no SMs (the ring of
:mod:`~megatron_grpo.ops.layers.ring_linear` runs NCCL's P2P kernels beside the GEMMs, which cost
it more than they hid: docs/benchmarks.md). Notation as in ``ring_linear``: ``p`` TP ranks,
``s = p * s_l`` tokens, ``h`` / ``o`` in / out features, ``_l`` this rank's share.

* :func:`symm_allgather_linear` (column parallel): ``x_local [s_l, b, h]``, ``weight [o_l, h]``,
  ``bias [o_l] | None`` -> ``all_gather(x_local) @ weight.T + bias`` ``[s, b, o_l]``. Backward:
  ``d_x = reduce_scatter(d_y @ weight)`` by the fused op, while NCCL gathers the input again for
  ``d_weight`` (not saved: megatron-core's sequence-parallel layers gather it again too).
* :func:`symm_linear_reduce_scatter` (row parallel): ``x [s, b, h_l]``, ``weight [o, h_l]`` ->
  ``reduce_scatter(x @ weight.T)`` ``[s_l, b, o]``. Backward: ``d_x = all_gather(d_y) @ weight``
  by the fused op, which also returns the gathered ``d_y`` for ``d_weight``.

On CUDA the ops need symmetric memory for the TP group (enabled here at the first call; NVLink
P2P within a node; NVLink multicast may stay off: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``). On
other devices (the CPU tests over gloo) the ops' definitions run instead, the collective then
the matmul (:func:`_reference_all_gather_matmul`, :func:`_reference_matmul_reduce_scatter`): the
results the fused ops are specified to give, up to the order of the reduction's terms.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.ops.layers.ring_linear import check_sequence, weight_grad

__all__ = ["SymmGroup", "symm_allgather_linear", "symm_linear_reduce_scatter"]


class SymmGroup:
    """The TP group as the fused ops name it; on CUDA, symmetric memory enabled for it (once,
    on every rank: the layers of a model build theirs at their first forward, in the same
    order on each rank)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.name = group.group_name
        self._enabled = False

    def enable(self) -> None:
        """Before torch 2.11 the fused ops need the group enabled; later releases mark the call
        deprecated (not needed) and warn."""
        if self._enabled:
            return
        from torch.distributed import _symmetric_memory as symm_mem

        enable = symm_mem.enable_symm_mem_for_group
        needed = getattr(enable, "__deprecated__", None) is None
        if needed and not symm_mem.is_symm_mem_enabled_for_group(self.name):
            enable(self.name)
        self._enabled = True


def _reference_all_gather_matmul(
    a_shard: Tensor, b: Tensor, group: SymmGroup, return_a: bool
) -> tuple[Tensor | None, Tensor]:
    """``fused_all_gather_matmul``'s result for ``gather_dim=0``: ``(all_gather(a_shard),
    all_gather(a_shard) @ b)``."""
    a = a_shard.new_empty((group.size * a_shard.shape[0], *a_shard.shape[1:]))
    dist.all_gather_into_tensor(a, a_shard.contiguous(), group=group.group)
    return (a if return_a else None), torch.matmul(a, b)


def _reference_matmul_reduce_scatter(a: Tensor, b: Tensor, group: SymmGroup) -> Tensor:
    """``fused_matmul_reduce_scatter``'s result for ``scatter_dim=0``, ``"sum"``."""
    full = torch.matmul(a, b)
    out = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))
    dist.reduce_scatter_tensor(out, full.contiguous(), group=group.group)
    return out


def _all_gather_matmul(
    a_shard: Tensor, b: Tensor, group: SymmGroup, return_a: bool
) -> tuple[Tensor | None, Tensor]:
    """``(all_gather(a_shard) or None, all_gather(a_shard) @ b)`` along dim 0."""
    if not a_shard.is_cuda:
        return _reference_all_gather_matmul(a_shard, b, group, return_a)
    group.enable()
    a, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(
        a_shard.contiguous(), [b], 0, group.name, return_A=return_a
    )
    return a, out


def _matmul_reduce_scatter(a: Tensor, b: Tensor, group: SymmGroup) -> Tensor:
    """``reduce_scatter(a @ b)`` (sum) along dim 0."""
    if not a.is_cuda:
        return _reference_matmul_reduce_scatter(a, b, group)
    group.enable()
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(a.contiguous(), b, "sum", 0, group.name)


class _SymmAllGatherLinear(torch.autograd.Function):
    """See :func:`symm_allgather_linear`."""

    @staticmethod
    def forward(ctx, x_local, weight, bias, group: SymmGroup):
        ctx.save_for_backward(x_local, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        _, out = _all_gather_matmul(x_local, weight.t(), group, return_a=False)
        return out if bias is None else out.add_(bias)

    @staticmethod
    def backward(ctx, d_out):
        x_local, weight = ctx.saved_tensors
        group, d_out = ctx.group, d_out.contiguous()
        need_w = ctx.needs_input_grad[1]
        gathered, work = None, None
        if need_w:  # the input again, on NCCL's stream while the fused op runs
            gathered = x_local.new_empty((group.size * x_local.shape[0], *x_local.shape[1:]))
            work = dist.all_gather_into_tensor(gathered, x_local, group=group.group, async_op=True)
        d_x = _matmul_reduce_scatter(d_out, weight, group)
        d_w = None
        if need_w:
            work.wait()
            d_w = weight_grad(d_out, gathered)
        d_b = d_out.reshape(-1, d_out.shape[-1]).sum(0) if ctx.has_bias else None
        return d_x, d_w, d_b, None


class _SymmLinearReduceScatter(torch.autograd.Function):
    """See :func:`symm_linear_reduce_scatter`."""

    @staticmethod
    def forward(ctx, x, weight, group: SymmGroup):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return _matmul_reduce_scatter(x, weight.t(), group)

    @staticmethod
    def backward(ctx, d_out):
        x, weight = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1]
        d_y, d_x = _all_gather_matmul(d_out.contiguous(), weight, ctx.group, return_a=need_w)
        d_w = weight_grad(d_y, x) if need_w else None
        return d_x, d_w, None


def symm_allgather_linear(
    x_local: Tensor, weight: Tensor, bias: Tensor | None, group: dist.ProcessGroup | SymmGroup
) -> Tensor:
    """``all_gather(x_local) @ weight.T + bias`` over ``group`` (sequence-parallel column layer).

    Args:
        x_local: ``[s_l, b, h]`` this rank's sequence chunk.
        weight: ``[o_l, h]`` this rank's output rows.
        bias: ``[o_l]`` or None.
        group: the TP group (or its :class:`SymmGroup`, built once by a layer).
    Returns:
        ``[s, b, o_l]``; backward gives ``d_x_local [s_l, b, h]`` reduce-scattered.
    """
    group = group if isinstance(group, SymmGroup) else SymmGroup(group)
    return _SymmAllGatherLinear.apply(x_local.contiguous(), weight, bias, group)


def symm_linear_reduce_scatter(
    x: Tensor, weight: Tensor, group: dist.ProcessGroup | SymmGroup
) -> Tensor:
    """``reduce_scatter(x @ weight.T)`` over ``group`` (sequence-parallel row layer, no bias).

    Args:
        x: ``[s, b, h_l]`` the whole sequence, this rank's input features.
        weight: ``[o, h_l]`` this rank's input columns.
        group: the TP group (or its :class:`SymmGroup`).
    Returns:
        ``[s_l, b, o]`` this rank's sequence chunk of the sum over the TP ranks.
    """
    group = group if isinstance(group, SymmGroup) else SymmGroup(group)
    check_sequence(x, group.size, "symm_linear_reduce_scatter input")
    return _SymmLinearReduceScatter.apply(x.contiguous(), weight, group)
