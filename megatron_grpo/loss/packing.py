"""Padded ``[B, L]`` batches <-> packed ``[T]`` tensors + ``cu_seqlens`` ``[B+1]``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def _check_mask(attention_mask: Tensor) -> None:
    if not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.bool:
        raise ValueError("attention_mask must be a bool [B, L] tensor")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must have shape [B, L], got {list(attention_mask.shape)}")


def pack_padded(
    attention_mask: Tensor, tensors: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor], Tensor]:
    """Pack padded tensors into the flat form ``grpo_loss`` takes.

    Args:
        attention_mask: ``[B, L]`` bool, True at real tokens (left or right padding, or holes).
        tensors: name -> ``[B, L]`` tensor, or ``[B]`` per-sequence value (e.g. advantages),
            broadcast to the sequence's tokens.

    Returns:
        ``(packed, cu_seqlens)``: name -> ``[T]`` tensor (row-major order of the real tokens,
        dtype kept) and ``cu_seqlens`` ``[B+1]`` int32 (row b is sequence b, possibly empty).
    """
    _check_mask(attention_mask)
    b, length = attention_mask.shape
    packed = {}
    for name, x in tensors.items():
        if not isinstance(x, Tensor) or x.shape not in ((b, length), (b,)):
            shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape [B, L]=[{b}, {length}] or [B], got {shape}")
        if x.device != attention_mask.device:
            raise ValueError(f"{name} is on {x.device}, attention_mask on {attention_mask.device}")
        if x.dim() == 1:
            x = x[:, None].expand(b, length)
        packed[name] = x[attention_mask]
    lengths = attention_mask.sum(dim=1)
    cu_seqlens = torch.zeros(b + 1, dtype=torch.int32, device=attention_mask.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return packed, cu_seqlens


def unpack_to_padded(packed: Tensor, attention_mask: Tensor, fill_value: float = 0.0) -> Tensor:
    """Inverse of :func:`pack_padded`: ``[T]`` -> ``[B, L]`` with ``fill_value`` at padding.

    Differentiable w.r.t. ``packed``.
    """
    _check_mask(attention_mask)
    total = int(attention_mask.sum())
    if not isinstance(packed, Tensor) or packed.shape != (total,):
        shape = list(packed.shape) if isinstance(packed, Tensor) else type(packed).__name__
        raise ValueError(f"packed must have shape [T]=[{total}], got {shape}")
    out = torch.full(attention_mask.shape, fill_value, dtype=packed.dtype, device=packed.device)
    return out.masked_scatter(attention_mask, packed)
