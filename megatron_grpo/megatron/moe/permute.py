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

:func:`gather_rows` and :func:`sum_rows` are the row gather and row sum of every dispatch of
ours (the local and gathered ones, the all-to-all's sort permute), each the other's backward,
the sums in one pass (``ops.layers.gather_sum``).
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


class _GatherRows(torch.autograd.Function):
    """``src [N, D]`` -> ``src[rows]`` ``[R, D]``; backward: row n's gradient is the fp32 sum of
    the output rows ``back[n, :]`` (``>= R``: none) in one pass (``ops.layers.gather_sum``: no
    atomics, deterministic, one rounding)."""

    @staticmethod
    def forward(ctx, src: Tensor, rows: Tensor, back: Tensor, impl: str) -> Tensor:
        ctx.save_for_backward(back)
        ctx.impl = impl
        return src.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (back,) = ctx.saved_tensors
        return gather_sum(grad, back, grad.dtype, impl=ctx.impl), None, None, None


class _SumRows(torch.autograd.Function):
    """``y [M, D]`` -> ``[N, D]`` in ``out_dtype``: row n is the fp32 sum of ``y[back[n, :]]``
    (``>= M``: nothing), rounded once; backward: row j of ``y`` gets the gradient of output row
    ``rows[j]`` (0 where ``valid[j]`` is False; ``valid`` None: every row is used)."""

    @staticmethod
    def forward(ctx, y: Tensor, back: Tensor, rows: Tensor, valid, out_dtype, impl: str) -> Tensor:
        ctx.save_for_backward(rows, valid)
        ctx.dtype = y.dtype
        return gather_sum(y, back, out_dtype, impl=impl)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, valid = ctx.saved_tensors
        g = grad.index_select(0, rows)
        if valid is not None:
            g = torch.where(valid[:, None], g, torch.zeros((), dtype=g.dtype, device=g.device))
        return g.to(ctx.dtype), None, None, None, None, None


def gather_rows(src: Tensor, rows: Tensor, back: Tensor, impl: str = "auto") -> Tensor:
    """``src[rows]`` whose backward sums each source row's uses ``back [N, S]`` (the inverse of
    ``rows``: the output rows of source row n, ``>= len(rows)`` where unused) without atomics;
    ``impl``: ``LayerKernels.elementwise`` (``ops.layers.gather_sum``)."""
    return _GatherRows.apply(src, rows, back, impl)


def sum_rows(
    y: Tensor,
    back: Tensor,
    rows: Tensor,
    valid: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    impl: str = "auto",
) -> Tensor:
    """Row n: the fp32 sum of ``y [M, D]``'s rows ``back[n, :]`` (``>= M``: nothing) in
    ``out_dtype`` (default ``y``'s); ``rows [M]`` (row j's output row; ``valid [M]``: which rows
    count) routes the backward. The inverse of :func:`gather_rows`."""
    out_dtype = y.dtype if out_dtype is None else out_dtype
    return _SumRows.apply(y, back, rows, valid, out_dtype, impl)


def permute_tokens(x: Tensor, order: Tensor, inverse: Tensor, k: int, impl: str = "auto") -> Tensor:
    """Tokens ``x [T, H]`` to their ``T*k`` expert-sorted rows (:func:`sort_by_expert`); the
    backward sums each token's k rows (``impl``: ``LayerKernels.elementwise``)."""
    token = torch.div(order, k, rounding_mode="floor")
    return gather_rows(x, token, inverse.view(-1, k), impl)


def combine_tokens(y: Tensor, order: Tensor, inverse: Tensor, k: int, impl: str = "auto") -> Tensor:
    """Expert-sorted rows ``y [T*k, H]`` back to tokens ``[T, H]``, each token's k rows summed
    in fp32 and rounded once (``impl``: ``LayerKernels.elementwise``)."""
    token = torch.div(order, k, rounding_mode="floor")
    return sum_rows(y, inverse.view(-1, k), token, impl=impl)
