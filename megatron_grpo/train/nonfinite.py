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


def _grads_bad(model: list[torch.nn.Module]) -> bool:
    """Any of this rank's gradients (Megatron's ``main_grad`` where it keeps one) not finite.
    One flag per parameter on the device, then one host sync (not one per parameter)."""
    flags = []
    for chunk in model:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                flags.append(torch.isfinite(g).all())
    return bool(flags) and not bool(torch.stack(flags).all())
