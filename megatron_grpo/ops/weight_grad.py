"""Where the LM-head weight gradient goes: ``weight.main_grad`` (Megatron) or ``weight.grad``.

The gradient is accumulated over row chunks in fp32. With Megatron's DDP the weight carries an
fp32 ``main_grad`` buffer; it is accumulated into directly (gradient_accumulation_fusion
semantics) and autograd receives no weight gradient. When the weight also carries
``grad_added_to_main_grad`` (Megatron DDP sets it on every parameter) the flag is set and a
dummy gradient is returned instead of None, exactly as Megatron's own linear layers do: DDP's
post-accumulate hook, which marks the parameter ready for overlapped gradient reduction, only
runs when autograd delivers a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _main_grad(weight: Tensor) -> Tensor | None:
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None and main_grad.shape != weight.shape:
        raise ValueError(
            f"weight.main_grad has shape {list(main_grad.shape)}, expected {list(weight.shape)}"
        )
    return main_grad


def weight_grad_accumulator(weight: Tensor, direct: bool) -> Tensor:
    """An fp32 [V_local, H] accumulator: ``weight.main_grad`` itself when ``direct`` and it is
    fp32, else a fresh zero buffer (``direct=False`` when the result is scaled later)."""
    main_grad = _main_grad(weight)
    if direct and main_grad is not None and main_grad.dtype == torch.float32:
        return main_grad
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)


def finish_weight_grad(weight: Tensor, acc: Tensor) -> Tensor | None:
    """Lands the accumulated gradient; returns what autograd should get for ``weight``."""
    main_grad = _main_grad(weight)
    if main_grad is None:
        return acc if weight.dtype == torch.float32 else acc.to(weight.dtype)
    if acc is not main_grad:
        main_grad.add_(acc)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)
