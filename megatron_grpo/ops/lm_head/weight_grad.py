"""Where the LM-head weight gradient goes: ``weight.main_grad`` (Megatron) or ``weight.grad``.

The gradient is accumulated vocab tile by vocab tile in fp32, in one of the plan's modes
(``LMHeadPlan.weight_grad``, decided by :func:`megatron_grpo.ops.lm_head.plan.weight_grad_mode`):
"accumulate_fp32" *in place* where an fp32 buffer of the gradient already exists or is the
gradient itself: an fp32 ``weight.main_grad`` (Megatron DDP, gradient_accumulation_fusion
semantics), or a fresh fp32 gradient of an fp32 weight. Otherwise ("write_tiles": a new gradient
of a bf16 weight without main_grad; "add_tiles": a low-precision main_grad) each tile is summed in
an fp32 scratch and rounded once into the gradient (or, from a single row block, written by one
GEMM with an fp32 accumulator), so no fp32 buffer of the whole [V_local, H] shard exists beyond
the gradient itself.

With ``main_grad`` autograd receives no weight gradient. When the weight also carries
``grad_added_to_main_grad`` (Megatron DDP sets it on every parameter) the flag is set and a dummy
gradient is returned instead of None, exactly as Megatron's own linear layers do: DDP's
post-accumulate hook, which marks the parameter ready for overlapped gradient reduction, only
runs when autograd delivers a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.ops.lm_head.gemm import mm_f32


def main_grad_of(weight: Tensor) -> Tensor | None:
    """``weight.main_grad`` (shape-checked) or None."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None and main_grad.shape != weight.shape:
        raise ValueError(
            f"weight.main_grad has shape {list(main_grad.shape)}, expected {list(weight.shape)}"
        )
    return main_grad


class WeightGradSink:
    """The d_weight of one backward pass, delivered in vocab tiles of [Vc, H].

    ``n_valid``: rows ``>= n_valid`` (padded vocabulary) receive no tile and stay 0. ``mode``:
    the plan's ``weight_grad`` (module docstring; never "none": no sink then).
    """

    def __init__(self, weight: Tensor, n_valid: int, mode: str):
        self.weight = weight
        self.main_grad = main_grad_of(weight)
        # fresh: a new gradient in the weight's dtype whose tiles are each written exactly once
        self.fresh = mode == "write_tiles"
        if self.main_grad is not None:
            self.target = self.main_grad
        elif self.fresh:  # no zero fill of the whole shard: every valid row is written
            self.target = torch.empty_like(weight, memory_format=torch.contiguous_format)
            self.target[n_valid:].zero_()
        else:  # an fp32 weight's gradient, accumulated in place
            self.target = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        self.direct = mode == "accumulate_fp32"
        found = "add_tiles" if self.main_grad is not None else "write_tiles"
        found = "accumulate_fp32" if self.target.dtype == torch.float32 else found
        if mode != found:  # the plan was made for other buffers than the weight has now
            raise RuntimeError(
                f"weight_grad mode {mode!r}, but the weight's buffers need {found!r}"
            )

    def tile(self, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of the fp32 d_weight, to accumulate into in place."""
        if not self.direct:
            raise RuntimeError("WeightGradSink.tile: no fp32 d_weight to accumulate into")
        return self.target[start:stop]

    def add_product(self, start: int, stop: int, a: Tensor, b: Tensor) -> None:
        """``d_weight[start:stop] += a @ b`` as one GEMM: fp32 accumulation, one rounding."""
        out = self.target[start:stop]
        if self.direct:
            mm_f32(a, b, acc=out)
        elif self.fresh:
            torch.mm(a, b, out=out)
        else:
            torch.addmm(out, a, b, out=out)

    def commit(self, start: int, stop: int, acc: Tensor) -> None:
        """Adds a finished fp32 [stop - start, H] sum into d_weight (computed in fp32, rounded
        once)."""
        if self.fresh:
            self.target[start:stop].copy_(acc)
        else:
            self.target[start:stop].add_(acc)

    def finish(self) -> Tensor | None:
        """What autograd should get for ``weight``."""
        if self.main_grad is None:
            return self.target
        return main_grad_done(self.weight)


def main_grad_done(weight: Tensor) -> Tensor | None:
    """What autograd gets for a weight whose gradient went into ``main_grad`` (module doc)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)
