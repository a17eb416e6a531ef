"""The element-wise ops of the fused decode step: a pure-torch reference of each, and the choice
between it and the Triton kernel (``megatron_grpo.kernels``): :func:`decode_kernels`, called
once per engine by ``fused_decode.plan_decode`` (the plan carries the functions).

The references reproduce megatron-core's module path op by op in the model dtype (the rounding
of every intermediate included), so the fused step decodes the tokens the module path decodes;
the kernels compute the same roundings in one pass each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_grpo.ops.kernels import triton_kernels
from megatron_grpo.ops.layers.rms_norm import rms_norm_torch
from megatron_grpo.ops.layers.rope import rope_reference
from megatron_grpo.ops.layers.swiglu import swiglu_torch


def add_rms_norm_torch(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``res = residual + (x + bias)``, ``y = rms_norm(res) * weight`` (fp32, rounded once);
    ``[b, H]``. Like the kernel, ``res`` is written into ``residual`` in place."""
    t = x if bias is None else x + bias
    if residual is not None:
        t = residual.copy_(residual + t)
    return t, rms_norm_torch(t, weight, eps)


def qkv_rope_cache_torch(
    qkv: Tensor,
    groups: int,
    heads_per_group: int,
    pos: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    norm: tuple[Tensor, Tensor, float] | None = None,
    rope: tuple[Tensor, Tensor, bool] | None = None,
) -> Tensor:
    """Reference of ``kernels.qkv_rope_cache``: ``qkv [b, G * (R + 2) * D]`` -> ``q [b, G, R, D]``
    with row i's key / value written at ``k/v_cache[i, :, pos[i]]``."""
    b, d, r = qkv.size(0), k_cache.size(-1), heads_per_group
    heads = qkv.view(b, groups, r + 2, d)
    q, k, v = heads[:, :, :r], heads[:, :, r], heads[:, :, r + 1]
    if norm is not None:
        qw, kw, eps = norm
        q, k = rms_norm_torch(q, qw, eps), rms_norm_torch(k, kw, eps)
    if rope is not None:
        cos, sin, interleaved = rope
        c, s = cos[pos][:, None, None], sin[pos][:, None, None]  # [b, 1, 1, ROT]
        q = rope_reference(q, c, s, interleaved)
        k = rope_reference(k[:, :, None], c, s, interleaved)[:, :, 0]
    rows = torch.arange(b, device=qkv.device)
    k_cache[rows, :, pos] = k
    v_cache[rows, :, pos] = v
    return q.contiguous()


class DecodeKernels(NamedTuple):
    """The functions a decode step calls: the fused step's element-wise ops, and the one-kernel
    untruncated sampler (``kernels.sample_rows``; None: ``sampling.sample``'s torch path)."""

    add_rms_norm: Callable
    qkv_rope_cache: Callable
    swiglu: Callable
    sample_rows: Callable | None


def decode_kernels(impl: str) -> DecodeKernels:
    """The decode functions of a resolved ``impl`` ("torch" or "triton":
    :func:`megatron_grpo.ops.kernels.resolve_impl`)."""
    if impl == "torch":
        return DecodeKernels(add_rms_norm_torch, qkv_rope_cache_torch, swiglu_torch, None)
    if impl == "triton":
        k = triton_kernels
        return DecodeKernels(k.add_rms_norm, k.qkv_rope_cache, k.swiglu, k.sample_rows)
    raise ValueError(f"decode kernel impl must be 'torch' or 'triton', got {impl!r}")
