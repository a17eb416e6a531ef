"""Group-relative advantage estimators (GRPO, Dr.GRPO, RLOO) over rollout groups."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Estimator = Literal["grpo", "dr_grpo", "rloo"]
ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _check(rewards: Tensor, group_ids: Tensor, estimator: str, eps: float) -> None:
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a float [B] tensor, got {_desc(rewards)}")
    if not isinstance(group_ids, Tensor) or group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have shape [B]=[{rewards.numel()}], got {_desc(group_ids)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards has non-finite values")


def _desc(x: object) -> str:
    return f"{x.dtype} {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


def compute_advantages(
    rewards: Tensor, group_ids: Tensor, estimator: Estimator = "grpo", eps: float = 1e-6
) -> Tensor:
    """Per-sample advantages ``[B]`` (float32) from scalar ``rewards`` ``[B]``.

    ``group_ids`` ``[B]`` (any integers, not necessarily contiguous) groups the samples drawn
    for the same prompt. With the group mean m, unbiased std s (as ``torch.std``) and size n:

    * ``"grpo"``: ``(r - m) / (s + eps)``;
    * ``"dr_grpo"``: ``r - m``;
    * ``"rloo"``: ``r - mean of the other n - 1 rewards`` = ``n / (n - 1) * (r - m)``.

    Groups of one sample or with all-equal rewards give exactly 0 (never NaN).
    """
    _check(rewards, group_ids, estimator, eps)
    r = rewards.detach().double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(groups, dtype=torch.float64, device=r.device).index_add(0, inv, r * 0 + 1)
    mean = torch.zeros_like(count).index_add(0, inv, r) / count
    centred = r - mean[inv]
    lo = torch.full_like(count, float("inf")).scatter_reduce(0, inv, r, "amin")
    hi = torch.full_like(count, float("-inf")).scatter_reduce(0, inv, r, "amax")
    degenerate = ((count < 2) | (lo == hi))[inv]
    n = count[inv]
    if estimator == "grpo":
        var = torch.zeros_like(count).index_add(0, inv, centred * centred)
        std = (var / (count - 1).clamp(min=1)).sqrt()[inv]
        adv = centred / (std + eps)
    elif estimator == "dr_grpo":
        adv = centred
    else:
        adv = centred * n / (n - 1).clamp(min=1)
    return torch.where(degenerate, torch.zeros_like(adv), adv).float()
