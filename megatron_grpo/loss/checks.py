"""Input validation for the loss: errors name the offending tensor or argument.

A check of tensor *values* reads them on the host, which on a GPU waits for the GPU to drain.
So value checks are also written as a :class:`DeviceCheck` (a device-side count of violations):
a caller fetches all of them with :func:`fetch` in one copy, and only a failed check re-runs its
host-side version, for the exact error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from megatron_grpo.loss.config import GRPOLossConfig

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class DeviceCheck:
    """A value check still on the device: ``bad`` an integer scalar tensor (0 = passed),
    ``explain()`` the host-side check, which raises the error (run only on a failure)."""

    bad: Tensor
    explain: Callable[[], None]


# a caller's check of its inputs at the valid rows (bool [T]) of the loss
RowCheck = Callable[[Tensor], DeviceCheck]


def fetch(found: Sequence[DeviceCheck], *values: Tensor) -> list[int]:
    """The one host sync: every check's count and ``values`` (integer scalars on one device) in
    one copy. Raises the first failed check's error, else returns ``values`` as ints."""
    device = values[0].device
    out = torch.stack([x.to(device) for x in (*(c.bad for c in found), *values)]).tolist()
    for check, bad in zip(found, out[: len(found)], strict=True):
        if bad:
            check.explain()
            raise RuntimeError(f"{check.explain} passed where its device-side count did not")
    return out[len(found) :]


def check_config(cfg: object) -> GRPOLossConfig:
    if not isinstance(cfg, GRPOLossConfig):
        raise TypeError(f"cfg must be a GRPOLossConfig, got {type(cfg).__name__}")
    return cfg


def check_float(name: str, x: Tensor | None, length: int, device: torch.device) -> None:
    """``x`` must be a floating ``[length]`` tensor on ``device`` (None passes)."""
    if x is None:
        return
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != (length,):
        raise ValueError(f"{name} must have shape [T]=[{length}], got {list(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be bf16/fp16/fp32/fp64, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but loss_mask is on {device}")


def check_mask(loss_mask: Tensor) -> None:
    if not isinstance(loss_mask, Tensor):
        raise TypeError(f"loss_mask must be a torch.Tensor, got {type(loss_mask).__name__}")
    if loss_mask.dtype != torch.bool or loss_mask.dim() != 1:
        raise ValueError(
            f"loss_mask must be a bool [T] tensor, got {loss_mask.dtype} {list(loss_mask.shape)}"
        )


def check_required(
    cfg: GRPOLossConfig,
    ref_logprobs: Tensor | None,
    rollout_logprobs: Tensor | None,
) -> None:
    """Inputs that an enabled option needs."""
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when kl_coef > 0")
    if cfg.is_correction_level is not None and rollout_logprobs is None:
        raise ValueError(
            f"rollout_logprobs is required when is_correction_level={cfg.is_correction_level!r}"
        )


def check_entropy_needed(cfg: GRPOLossConfig, entropy: Tensor | None) -> None:
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("entropy is required when entropy_coef != 0")


def check_denominator(denominator: float | Tensor | None) -> None:
    if denominator is None:
        return
    if isinstance(denominator, Tensor):
        if denominator.numel() != 1:
            raise ValueError(
                f"denominator must be a scalar count, got shape {list(denominator.shape)}"
            )
        value = float(denominator.detach().reshape(()).cpu())
    elif isinstance(denominator, (int, float)) and not isinstance(denominator, bool):
        value = float(denominator)
    else:
        raise TypeError(f"denominator must be a number or a scalar tensor, got {denominator!r}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"denominator must be a finite count > 0, got {value}")


def denominator_checks(
    denominator: float | Tensor | None, device: torch.device
) -> list[DeviceCheck]:
    """:func:`check_denominator`, with the value of a tensor on ``device`` left to the caller's
    :func:`fetch` (reading it now would sync); returns the deferred checks."""
    if not (isinstance(denominator, Tensor) and denominator.device == device):
        check_denominator(denominator)
        return []
    if denominator.numel() != 1:
        check_denominator(denominator)  # raises its shape error
    d = denominator.detach().reshape(())
    bad = ((d > 0) & (d != math.inf)).logical_not().long()
    return [DeviceCheck(bad, partial(check_denominator, denominator))]


def nonfinite_rows(named: dict[str, Tensor], valid: Tensor, raise_: bool) -> Tensor:
    """Bool mask of ``valid`` positions where any tensor of ``named`` is non-finite.

    With ``raise_`` a hit raises ``ValueError`` naming the first offending tensor (one host
    sync for all tensors).
    """
    bad = {name: valid & ~torch.isfinite(x) for name, x in named.items()}
    if raise_ and bad:
        counts = torch.stack([b.sum() for b in bad.values()]).tolist()
        for (name, b), count in zip(bad.items(), counts, strict=True):
            if count:
                first = int(b.nonzero()[0, 0])
                raise ValueError(
                    f"{name} has {count} non-finite value(s) at unmasked positions "
                    f"(first at index {first}: {named[name][first].item()})"
                )
    out = torch.zeros_like(valid)
    for b in bad.values():
        out |= b
    return out


def nonfinite_check(named: dict[str, Tensor], valid: Tensor) -> DeviceCheck:
    """``nonfinite_rows(named, valid, raise_=True)`` as a count for the caller's :func:`fetch`."""
    bad = torch.stack([(valid & ~torch.isfinite(x)).sum() for x in named.values()]).sum()
    return DeviceCheck(bad, partial(nonfinite_rows, named, valid, True))
