"""Input validation for the loss: errors name the offending tensor or argument."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.loss.config import GRPOLossConfig

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


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
