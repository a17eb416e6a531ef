"""Token permutation of megatron-core's MoE dispatchers without a per-expert Python loop.

megatron-core's all-to-all dispatcher orders the received tokens by local expert (and back,
before the combine) with ``moe_utils.sort_chunks_by_idxs``: without Transformer Engine
(``moe_permute_fusion``) that splits the rows into one chunk per (rank, local expert), ``cat``s
them in the new order (a loop over 128 chunks for Qwen3-30B-A3B at EP 1, where the order does
not even change) and syncs with the host twice (``tolist``). :func:`sort_chunks_by_index` is the
same permutation as one gather (``index_select``; its backward a gather too), with the row
indices built on the device; at the identity order (EP = TP = 1) it copies nothing.
``compat.use_index_chunk_sort`` installs it in the dispatcher; tests compare it with
megatron-core's own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.ops.layers.gather_sum import gather_sum
from megatron_grpo.ops.layers.sort_keys import sort_keys


def chunk_sort_rows(split_sizes: Tensor, sorted_idxs: Tensor, device: torch.device) -> Tensor:
    """Row indices ``[T]`` of the chunks of ``split_sizes [S]`` concatenated in the order
    ``sorted_idxs [S]`` (one index per chunk): ``rows[j]`` is the input row at output row ``j``.
    No host sync (``T`` comes from ``split_sizes`` where it is on the host)."""
    sizes = host_to_device(split_sizes.long(), device)
    order = host_to_device(sorted_idxs.long(), device)
    starts = torch.cumsum(sizes, 0) - sizes  # input start of each chunk
    out_sizes = sizes[order]
    out_starts = torch.cumsum(out_sizes, 0) - out_sizes
    total = int(split_sizes.sum()) if split_sizes.device.type == "cpu" else None
    shift = torch.repeat_interleave(starts[order] - out_starts, out_sizes, output_size=total)
    return torch.arange(shift.numel(), device=device) + shift


def sort_chunks_by_index(
    input: Tensor,
    split_sizes: Tensor,
    sorted_idxs: Tensor,
    probs: Tensor | None = None,
    fused: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """megatron-core's ``sort_chunks_by_idxs`` contract: ``input [T, ...]`` (and ``probs [T]``)
    split into chunks of ``split_sizes [S]`` and concatenated in the order ``sorted_idxs
    [S]``. ``fused`` (Transformer Engine's kernels) is refused: the dispatcher only asks for it
    with ``moe_permute_fusion``, which megatron-core itself rejects without TE."""
    if fused:
        raise ValueError("sort_chunks_by_index has no fused (Transformer Engine) variant")
    n = sorted_idxs.numel()
    if sorted_idxs.device.type == "cpu" and torch.equal(sorted_idxs, torch.arange(n)):
        return input, probs  # the identity order (one rank): nothing moves
    rows = chunk_sort_rows(split_sizes, sorted_idxs, input.device)
    return _PermuteRows.apply(input, rows), None if probs is None else _PermuteRows.apply(
        probs, rows
    )


class _PermuteRows(torch.autograd.Function):
    """``x [T, ...]`` -> ``x[rows]`` for a permutation ``rows [T]``; backward: the gradient
    gathered by the inverse permutation. (``index_select``'s own backward is an ``index_add``
    with atomics: at EP 4 on 4 H200s its kernel took ~10% of the MoE twin's update.)"""

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor) -> Tensor:
        if ctx.needs_input_grad[0]:
            inverse = torch.empty_like(rows)
            inverse[rows] = torch.arange(rows.numel(), device=rows.device)
            ctx.save_for_backward(inverse)
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None


def sort_by_expert(
    expert_ids: Tensor, num_experts: int, sort: str = "auto"
) -> tuple[Tensor, Tensor, Tensor]:
    """Sort-based routing of ``expert_ids [T, k]`` (each token's k distinct experts) without a
    host sync: ``(order [T*k], inverse [T*k], tokens_per_expert [E])``. ``order`` lists the
    (token, slot) pairs expert-major and token-ascending within an expert (megatron-core's
    permuted layout: ``order // k`` is the token of each permuted row); ``inverse`` is its
    inverse permutation (``inverse.view(T, k)`` holds each token's permuted rows). ``sort``:
    ``LayerKernels.moe_sort`` (``ops.layers.sort_keys``)."""
    n = expert_ids.numel()
    return sort_keys(expert_ids, 0, num_experts, n, sort)


class _Permute(torch.autograd.Function):
    """``x [T, H]`` -> ``x[order // k]`` ``[T*k, H]``; backward: each token's k rows gathered
    and summed in one pass (``ops.layers.gather_sum``: no atomics, deterministic, one
    rounding)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor, k: int, impl: str) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.impl = k, impl
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        rows = inverse.view(-1, ctx.k)
        return gather_sum(grad, rows, grad.dtype, impl=ctx.impl), None, None, None, None


class _Combine(torch.autograd.Function):
    """``y [T*k, H]`` (permuted rows, probs applied) -> ``[T, H]``: each token's k rows summed
    in fp32 in one pass, rounded once; backward: the token's gradient gathered to each of its
    rows."""

    @staticmethod
    def forward(ctx, y: Tensor, order: Tensor, inverse: Tensor, k: int, impl: str) -> Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return gather_sum(y, inverse.view(-1, k), y.dtype, impl=impl)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        token = torch.div(order, ctx.k, rounding_mode="floor")
        return grad.index_select(0, token), None, None, None, None


def permute_tokens(x: Tensor, order: Tensor, inverse: Tensor, k: int, impl: str = "auto") -> Tensor:
    """Tokens ``x [T, H]`` to their ``T*k`` expert-sorted rows (:func:`sort_by_expert`);
    ``impl``: the backward's row sums (``LayerKernels.elementwise``)."""
    return _Permute.apply(x, order, inverse, k, impl)


def combine_tokens(y: Tensor, order: Tensor, inverse: Tensor, k: int, impl: str = "auto") -> Tensor:
    """Expert-sorted rows ``y [T*k, H]`` back to tokens ``[T, H]``, summing each token's k
    (``impl``: ``LayerKernels.elementwise``)."""
    return _Combine.apply(y, order, inverse, k, impl)
