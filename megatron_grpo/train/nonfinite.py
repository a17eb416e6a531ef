"""The non-finite skip policy: an optimizer step whose inputs, loss or gradients are not finite
on any rank is skipped (on every rank alike); too many in a row abort the run.

Inputs are checked before the forward (so a bad rollout costs no pass), the loss and gradients
after the backward. The verdicts are collectives over the whole world, so all ranks skip the
same steps and stay in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.train import comm
from megatron_grpo.train.batching import PER_TOKEN_INPUTS, nonfinite_inputs


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps were skipped for non-finite values."""


class NonFiniteGuard:
    """Counts skipped steps (``skipped``: the run's total, restored on resume) and raises
    :class:`NonFiniteError` after ``limit`` consecutive ones (``training.
    max_consecutive_nonfinite_skips``). ``message``: where a skip is reported."""

    def __init__(self, limit: int, message: Callable[[str], None], skipped: int = 0) -> None:
        self.limit, self.message = limit, message
        self.skipped, self.consecutive = skipped, 0

    @staticmethod
    def inputs(micro_batches: list[PackedBatch]) -> str | None:
        """Why the mini-batch's inputs forbid the step (on any rank), or None."""
        flags = comm.any_rank(nonfinite_inputs(micro_batches))
        names = [n for n, bad in zip(PER_TOKEN_INPUTS, flags, strict=True) if bad]
        return f"non-finite input(s): {', '.join(names)}" if names else None

    @staticmethod
    def loss_or_grads(reports: list[dict[str, Any]], model: list[torch.nn.Module]) -> str | None:
        """Why the finished backward forbids the step (on any rank), or None."""
        loss_bad = any(
            not bool(torch.isfinite(torch.as_tensor(r["loss/loss"].sum)).all())
            for r in reports
            if "loss/loss" in r
        )
        loss_bad, grads_bad = comm.any_rank([loss_bad, _grads_bad(model)])
        if loss_bad:
            return "non-finite loss (inputs were finite: the policy's log-probs overflowed)"
        return "non-finite gradients" if grads_bad else None

    def stepped(self) -> None:
        """An optimizer step was taken: the run of skips is over."""
        self.consecutive = 0

    def skip(self, reason: str) -> None:
        """Record a skipped step; raises once ``limit`` were skipped in a row."""
        self.skipped += 1
        self.consecutive += 1
        self.message(
            f"skipped an optimizer step: {reason} ({self.consecutive} in a row, "
            f"{self.skipped} in total)"
        )
        if self.consecutive >= self.limit:
            raise NonFiniteError(
                f"{self.consecutive} consecutive optimizer steps skipped (last: {reason}); "
                f"training.max_consecutive_nonfinite_skips={self.limit}"
            )


# elements per isfinite check: its bool temporary stays at 64 MiB however large a buffer is
CHECK_ELEMENTS = 1 << 26


def _grad_tensors(chunk: torch.nn.Module) -> list[torch.Tensor]:
    """``chunk``'s gradients as few large tensors: megatron-core DDP's contiguous gradient
    buffers (dense and expert) and the ``main_grad`` s outside them (0.19 may promote some to
    fp32 tensors of their own) where it has buffers, else each parameter's ``main_grad`` or
    ``grad``."""
    buffers = [
        b.grad_data
        for name in ("buffers", "expert_parallel_buffers")
        if isinstance(group := getattr(chunk, name, None), list | tuple)
        for b in group
        if isinstance(getattr(b, "grad_data", None), torch.Tensor)
    ]
    if buffers:
        inside = {b.untyped_storage().data_ptr() for b in buffers}
        mains = (getattr(p, "main_grad", None) for p in chunk.parameters())
        extra = [g for g in mains if g is not None and g.untyped_storage().data_ptr() not in inside]
        return buffers + extra
    grads = (getattr(p, "main_grad", None) for p in chunk.parameters())
    return [
        g if g is not None else p.grad
        for p, g in zip(chunk.parameters(), grads, strict=True)
        if g is not None or p.grad is not None
    ]


def _grads_bad(model: list[torch.nn.Module]) -> bool:
    """Any of this rank's gradients (Megatron's ``main_grad`` where it keeps one) not finite.
    One flag per gradient buffer (in pieces of ``CHECK_ELEMENTS``) on the device, then one host
    sync: a few reductions instead of one per parameter (225 on the MoE twin)."""
    flags = [
        torch.isfinite(piece).all()
        for chunk in model
        for g in _grad_tensors(chunk)
        for piece in g.reshape(-1).split(CHECK_ELEMENTS)
    ]
    return bool(flags) and not bool(torch.stack(flags).all())
