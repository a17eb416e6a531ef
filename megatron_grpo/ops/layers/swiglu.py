"""SwiGLU of an fc1 output, ``silu(gate) * up`` of the two halves (the portable spec's MLP).

* :func:`swiglu_torch`: the reference, megatron-core's unfused ``chunk`` / ``silu`` / ``mul``
  (each result rounded to the input dtype).
* ``impl="triton"``: ``kernels.swiglu`` forward and ``kernels.swiglu_bwd`` backward, the same
  roundings in one pass each way; only the input is saved for the backward (the reference saves
  the input and ``silu(gate)``).
* ``probs`` (the routed experts): each row scaled by its fp32 routing probability as
  megatron-core's expert MLP does (``(h * p).to(dtype)``), in the same single kernel each way
  (``kernels.swiglu_scaled``), whose backward also gives ``d probs``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_grpo.ops.kernels import MAX_SCALED_F, resolve_impl, triton_kernels


def swiglu_torch(x: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x (+ bias) [..., 2F]`` -> ``silu(x[..., :F]) * x[..., F:]`` ``[..., F]``: megatron-core's
    unfused gated SiLU (the training layer's reference and the decode step's torch op)."""
    if bias is not None:
        x = x + bias
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def _swiglu_triton(rows: Tensor, shape: torch.Size) -> Tensor:
    return triton_kernels.swiglu(rows).view(*shape[:-1], shape[-1] // 2)


class _SwiGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.size(-1)).contiguous()
        ctx.save_for_backward(rows)
        ctx.shape = x.shape
        return _swiglu_triton(rows, x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        g = grad.reshape(rows.size(0), -1).contiguous()
        return triton_kernels.swiglu_bwd(rows, g).view(ctx.shape)


class _SwiGLUScaledTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, probs: Tensor) -> Tensor:
        ctx.save_for_backward(x, probs)
        return triton_kernels.swiglu_scaled(x, probs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, probs = ctx.saved_tensors
        dx, dp = triton_kernels.swiglu_scaled_bwd(x, probs, grad.contiguous())
        return dx, dp.to(probs.dtype)


def swiglu_scaled_torch(x: Tensor, probs: Tensor) -> Tensor:
    """Reference: megatron-core's expert activation, ``(swiglu(x) * probs[:, None])`` in the
    probs' dtype, rounded to ``x``'s."""
    h = swiglu_torch(x)
    return (h * probs.unsqueeze(-1)).to(h.dtype)


def swiglu(x: Tensor, *, impl: str = "auto", probs: Tensor | None = None) -> Tensor:
    """SwiGLU of ``x [..., 2F]`` -> ``[..., F]`` in ``x``'s dtype; ``impl`` as
    :func:`megatron_grpo.ops.kernels.resolve_impl` decides ("auto": the kernels on CUDA).
    ``probs [rows]`` (x ``[rows, 2F]``): each row scaled by it (the routed experts)."""
    if x.size(-1) % 2:
        raise ValueError(f"swiglu: the last dim of x must be even (2F), got {list(x.shape)}")
    if probs is not None:
        return _swiglu_scaled(x, probs, impl)
    if resolve_impl(impl, x.device.type) == "torch":
        return swiglu_torch(x)
    if not (torch.is_grad_enabled() and x.requires_grad):  # no graph: skip Function.apply
        return _swiglu_triton(x.reshape(-1, x.size(-1)).contiguous(), x.shape)
    return _SwiGLUTriton.apply(x)


def _swiglu_scaled(x: Tensor, probs: Tensor, impl: str) -> Tensor:
    if x.dim() != 2 or probs.shape != (x.size(0),):
        raise ValueError(
            f"swiglu with probs: x must be [rows, 2F] and probs [rows], got {list(x.shape)} and "
            f"{list(probs.shape)}"
        )
    if resolve_impl(impl, x.device.type) == "torch":
        return swiglu_scaled_torch(x, probs)
    fits = probs.dtype == torch.float32 and x.size(1) // 2 <= MAX_SCALED_F
    if impl == "auto" and not fits:  # the kernel's limits (explicit "triton": its error)
        return swiglu_scaled_torch(x, probs)
    x, probs = x.contiguous(), probs.contiguous()
    if not (torch.is_grad_enabled() and (x.requires_grad or probs.requires_grad)):
        return triton_kernels.swiglu_scaled(x, probs)
    return _SwiGLUScaledTriton.apply(x, probs)
