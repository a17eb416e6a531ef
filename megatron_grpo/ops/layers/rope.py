"""Rotary position embedding with one ``cos`` / ``sin`` row per token: one op for any layout.

Packed (THD) micro-batches hold many documents whose positions restart at 0; gathering the
rotary table at each token's own position turns megatron-core's per-document loop into one op
per tensor. The math is megatron-core's unfused formula, ``x * cos + rotate_half(x) * sin`` on
the first ``ROT`` features, each product and the sum rounded to the tensor's dtype.

* :func:`apply_rotary_torch`: the reference, the same torch ops as megatron-core (equal to it bit
  for bit, forward and backward, in every dtype).
* ``impl="triton"``: ``kernels.rope`` forward and backward (one launch each, the same roundings).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.ops.kernels import resolve_impl, triton_kernels


def rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    """``[-x2, x1]`` of the two halves (or of the odd / even features when ``interleaved``)."""
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """megatron-core's unfused formula on the first ``ROT = cos.size(-1)`` features of ``x``
    (the rest pass through); ``cos, sin`` broadcast against ``x[..., :ROT]``, in ``x``'s dtype."""
    rot = cos.size(-1)
    head, rest = x[..., :rot], x[..., rot:]
    head = head * cos + rotate_half(head, interleaved) * sin
    return head if rest.size(-1) == 0 else torch.cat((head, rest), dim=-1)


def apply_rotary_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``x [T, n, d]``, ``cos, sin [T, ROT]`` in ``x``'s dtype -> ``[T, n, d]``."""
    return rope_reference(x, cos[:, None], sin[:, None], interleaved)  # [T, 1, ROT]: every head


def _rope_triton(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    return triton_kernels.rope(
        x if x.stride(-1) == 1 else x.contiguous(), cos, sin, interleaved=interleaved
    )


class _RotaryTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rope_triton(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        g = grad if grad.stride(-1) == 1 else grad.contiguous()
        return (
            triton_kernels.rope(g, cos, sin, interleaved=ctx.interleaved, backward=True),
            None,
            None,
            None,
        )


def apply_rotary(
    x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False, impl: str = "auto"
) -> Tensor:
    """RoPE of ``x [T, n, d]`` with per-token ``cos, sin [T, ROT]`` (``x``'s dtype, megatron's
    ``mscale`` already applied; ``ROT <= d`` even) -> ``[T, n, d]``.

    ``impl``: "torch" (:func:`apply_rotary_torch`), "triton" (the kernel) or "auto" (the kernel
    on CUDA when triton imports), as :func:`megatron_grpo.ops.kernels.resolve_impl` decides.
    """
    if x.dim() != 3 or cos.shape != (x.size(0), cos.size(-1)) or sin.shape != cos.shape:
        raise ValueError(
            f"apply_rotary: x must be [T, n, d] and cos, sin [T, ROT]; got x {list(x.shape)}, "
            f"cos {list(cos.shape)}, sin {list(sin.shape)}"
        )
    if resolve_impl(impl, x.device.type) == "torch":
        return apply_rotary_torch(x, cos, sin, interleaved)
    if not (torch.is_grad_enabled() and x.requires_grad):  # no graph: skip Function.apply
        return _rope_triton(x, cos.contiguous(), sin.contiguous(), interleaved)
    return _RotaryTriton.apply(x, cos.contiguous(), sin.contiguous(), interleaved)
