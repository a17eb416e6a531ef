"""SwiGLU of an fc1 output, ``silu(gate) * up`` of the two halves (the portable spec's MLP).

* :func:`swiglu_torch`: the reference, megatron-core's unfused ``chunk`` / ``silu`` / ``mul``
  (each result rounded to the input dtype).
* ``impl="triton"``: ``kernels.swiglu`` forward and ``kernels.swiglu_bwd`` backward, the same
  roundings in one pass each way; only the input is saved for the backward (the reference saves
  the input and ``silu(gate)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_grpo.ops.dispatch import resolve_impl


def swiglu_torch(x: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x (+ bias) [..., 2F]`` -> ``silu(x[..., :F]) * x[..., F:]`` ``[..., F]``: megatron-core's
    unfused gated SiLU (the training layer's reference and the decode step's torch op)."""
    if bias is not None:
        x = x + bias
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def _swiglu_triton(rows: Tensor, shape: torch.Size) -> Tensor:
    from megatron_grpo.kernels import swiglu

    return swiglu(rows).view(*shape[:-1], shape[-1] // 2)


class _SwiGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.size(-1)).contiguous()
        ctx.save_for_backward(rows)
        ctx.shape = x.shape
        return _swiglu_triton(rows, x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        from megatron_grpo.kernels import swiglu_bwd

        (rows,) = ctx.saved_tensors
        g = grad.reshape(rows.size(0), -1).contiguous()
        return swiglu_bwd(rows, g).view(ctx.shape)


def swiglu(x: Tensor, *, impl: str = "auto") -> Tensor:
    """SwiGLU of ``x [..., 2F]`` -> ``[..., F]`` in ``x``'s dtype; ``impl`` as
    :func:`megatron_grpo.ops.dispatch.resolve_impl` decides ("auto": the kernels on CUDA)."""
    if x.size(-1) % 2:
        raise ValueError(f"swiglu: the last dim of x must be even (2F), got {list(x.shape)}")
    if resolve_impl(impl, x.device.type) == "torch":
        return swiglu_torch(x)
    if not (torch.is_grad_enabled() and x.requires_grad):  # no graph: skip Function.apply
        return _swiglu_triton(x.reshape(-1, x.size(-1)).contiguous(), x.shape)
    return _SwiGLUTriton.apply(x)
