"""Rows gathered by index and summed per output row: ``out[n] = sum_s src[idx[n, s]]``.

The MoE dispatches sum each token's expert rows in their combines, and the backward of their
row gathers sums each token's row gradients the same way (``megatron/moe/permute.py``,
``megatron/moe/ep_dispatch.py``); an index ``>= M`` (in the gathered dispatch: a slot routed to
another rank's expert) adds nothing.

* :func:`gather_sum_torch`: the reference: a zero row appended to ``src``, ``index_select`` of
  ``[N * S]`` rows, a fp32 sum over the slots (three passes over memory, a copy of ``src``).
* ``impl="triton"``: ``kernels.gather_sum``, one pass: each used row read once, fp32 sums in
  slot order, as the reference adds them. "auto" takes it for rows of at least
  :data:`MIN_KERNEL_WIDTH` elements.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.ops.kernels import resolve_impl, triton_kernels

# one program per output row: on an H200 the kernel took 100 us against the reference's 437 at
# 32k rows of 4 x 1024 bf16, but 165 against 57 us at 262k rows of width 1 (the probs' gather)
MIN_KERNEL_WIDTH = 64


def gather_sum_torch(src: Tensor, idx: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``src [M, D]``, ``idx [N, S]`` int64 -> ``[N, D]`` in ``out_dtype`` (fp32 sums)."""
    padded = torch.cat([src, src.new_zeros(1, src.size(1))])
    rows = padded.index_select(0, idx.reshape(-1).clamp(max=src.size(0)))
    return rows.view(*idx.shape, src.size(1)).sum(1, dtype=torch.float32).to(out_dtype)


def gather_sum(src: Tensor, idx: Tensor, out_dtype: torch.dtype, *, impl: str = "auto") -> Tensor:
    """Row n of the result: the fp32 sum of ``src [M, D]``'s rows ``idx[n, :]`` (``idx [N, S]``
    int64; an index >= M adds nothing), in ``out_dtype``. ``impl``: "torch"
    (:func:`gather_sum_torch`), "triton" or "auto" (:func:`~megatron_grpo.ops.kernels.
    resolve_impl`, and the reference for rows narrower than :data:`MIN_KERNEL_WIDTH`)."""
    if src.dim() != 2 or idx.dim() != 2 or idx.dtype != torch.int64:
        raise ValueError(
            f"gather_sum: src must be [M, D] and idx [N, S] int64, got {list(src.shape)} and "
            f"{idx.dtype} {list(idx.shape)}"
        )
    narrow = impl == "auto" and src.size(1) < MIN_KERNEL_WIDTH
    if narrow or resolve_impl(impl, src.device.type) == "torch":
        return gather_sum_torch(src, idx, out_dtype)
    return triton_kernels.gather_sum(src.contiguous(), idx, out_dtype)
