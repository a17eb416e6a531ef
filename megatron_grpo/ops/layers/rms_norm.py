"""RMSNorm computed in fp32 and rounded once to the input dtype (the portable spec's norms).

* :func:`rms_norm_torch`: the reference, ``F.rms_norm`` on fp32 copies of input and weight.
* ``impl="triton"``: ``kernels.rms_norm`` forward and backward, the same math without the fp32
  copies (one read and one write per pass instead of five; the input, not its fp32 copy, is
  saved for the backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_grpo.ops.kernels import resolve_impl, triton_kernels


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension computed in fp32, returned in ``x``'s dtype."""
    return F.rms_norm(x.float(), (x.size(-1),), weight.float(), eps).to(x.dtype)


class _RMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, rstd = triton_kernels.rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = triton_kernels.rms_norm_bwd(grad, x, weight, rstd)
        return dx, dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, impl: str = "auto") -> Tensor:
    """RMSNorm of ``x [..., N]`` with ``weight [N]``, computed in fp32, in ``x``'s dtype.

    ``impl``: "torch" (:func:`rms_norm_torch`), "triton" (the kernels) or "auto" (the kernels
    on CUDA when triton imports), as :func:`megatron_grpo.ops.kernels.resolve_impl` decides.
    """
    if weight.dim() != 1 or x.size(-1) != weight.numel():
        raise ValueError(
            f"rms_norm: x [..., N] and weight [N] must agree, got {list(x.shape)} and "
            f"{list(weight.shape)}"
        )
    if resolve_impl(impl, x.device.type) == "torch":
        return rms_norm_torch(x, weight, eps)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return triton_kernels.rms_norm_fwd(x, weight, eps)[
            0
        ]  # no graph to record: skip Function.apply's cost
    return _RMSNormTriton.apply(x, weight, eps)
