"""Causal attention over packed (THD) documents in one ``torch.nn.attention.varlen`` call.

``varlen_attn`` (torch >= 2.10, FlashAttention-2 inside) takes the packed ``[T, n, d]`` tensors
and the documents' ``cu_seqlens``: one kernel per layer and direction whatever the number of
distinct document lengths (the length-bucketed SDPA of :mod:`.packed` launches one per bucket).
The bounds are read on the host once per micro-batch (:func:`.packed.cached_layout`: every layer
and the recompute in backward share the device copy); tokens after the last bound (TP/SP
padding) form one more document whose output is replaced by zeros.

Its signature moved between torch versions: 2.10 ``is_causal=`` and no ``scale``; 2.11
``window_size=(-1, 0)`` for causal and ``scale=``; 2.12+ also ``enable_gqa=`` (older ones get
K/V repeated to the query heads). :func:`varlen_unavailable` says why it cannot run on given
inputs (CPU, fp32, head dim, dropout, pre-Ampere GPU).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.attention.packed import cached_layout, static_max_len

_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _api() -> tuple[object | None, frozenset[str], str | None]:
    """(varlen_attn, its keyword names, why it cannot be used or None)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset(), f"torch {torch.__version__} has no torch.nn.attention.varlen"
    names = frozenset(inspect.signature(varlen_attn).parameters)
    if not names & {"window_size", "is_causal"}:
        return None, names, "torch's varlen_attn takes neither window_size nor is_causal"
    return varlen_attn, names, None


def varlen_unavailable(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> str | None:
    """Why ``varlen_attn`` cannot run ``q [T, n_q, d]``, ``k [T, n_kv, d]`` (None: it can)."""
    fn, _, why = _api()
    if fn is None:
        return why
    if q.device.type != "cuda":
        return f"varlen_attn runs on CUDA only (tensors on {q.device.type})"
    if q.dtype not in _DTYPES:
        return f"varlen_attn (FlashAttention-2) needs float16 or bfloat16, got {q.dtype}"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "varlen_attn (FlashAttention-2) needs an Ampere or newer GPU"
    d = q.size(-1)
    if d > 256 or d % 8:
        return f"varlen_attn needs a head dim <= 256 and a multiple of 8, got {d}"
    if q.size(1) % k.size(1):
        return f"{q.size(1)} query heads are not a multiple of {k.size(1)} key/value heads"
    if dropout_p > 0:
        return f"varlen_attn has no attention dropout (attention_dropout={dropout_p})"
    return None


@dataclass
class VarlenLayout:
    """The bounds varlen_attn gets: the documents' (empty ones dropped) plus the padding's."""

    cu: torch.Tensor  # int32 [N + 1] on the device
    max_len: int  # the longest document (padding included)
    end: int  # tokens at or after it are padding (zeros out)


def _layout(bounds: list[int], tokens: int, device: torch.device) -> VarlenLayout:
    if bounds[-1] > tokens:
        raise ValueError(
            f"packed_seq_params: the documents end at token {bounds[-1]} but q holds {tokens}"
        )
    cu = sorted(set(bounds) | {0, tokens})  # empty documents dropped, padding appended
    longest = max((b - a for a, b in zip(cu[:-1], cu[1:], strict=False)), default=0)
    cu_dev = host_to_device(torch.tensor(cu, dtype=torch.int32), device)
    return VarlenLayout(cu=cu_dev, max_len=longest, end=bounds[-1])


def varlen_layout(params: PackedSeqParams, tokens: int, device: torch.device) -> VarlenLayout:
    """The (cached) :class:`VarlenLayout` of ``params`` for ``tokens`` packed rows; static
    ``params`` (a captured forward) give their device bounds as they are: no empty document,
    padding included (``graph_shape.pad_to_shape``)."""
    longest = static_max_len(params)
    if longest is not None:
        cu = params.cu_seqlens_q
        if cu.dtype != torch.int32 or cu.device != device:
            raise ValueError(
                f"static packed_seq_params.cu_seqlens_q must be int32 on {device}, got "
                f"{cu.dtype} on {cu.device}"
            )
        return VarlenLayout(cu=cu, max_len=longest, end=tokens)
    return cached_layout(
        params, f"_grpo_varlen_layout_{tokens}", device, lambda b: _layout(b, tokens, device)
    )


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    *,
    scale: float,
) -> torch.Tensor:
    """Per-document causal attention: ``q [T, n_q, d]``, ``k, v [T, n_kv, d]`` -> ``[T, n_q, d]``
    (zeros after the last bound), in one ``varlen_attn`` call."""
    why = varlen_unavailable(q, k, 0.0)
    if why is not None:
        raise ValueError(f"packed attention 'varlen' cannot run: {why}")
    fn, names, _ = _api()
    layout = varlen_layout(params, q.size(0), q.device)
    kwargs: dict = {"window_size": (-1, 0)} if "window_size" in names else {"is_causal": True}
    groups = q.size(1) // k.size(1)
    if groups > 1 and "enable_gqa" in names:
        kwargs["enable_gqa"] = True
    elif groups > 1:  # torch < 2.12: K/V at every query head
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    if "scale" in names:
        kwargs["scale"] = scale
    elif not math.isclose(scale, q.size(-1) ** -0.5, rel_tol=1e-12):
        q = q * (scale * math.sqrt(q.size(-1)))  # torch 2.10: its scale is 1 / sqrt(d)
    m = layout.max_len
    out = fn(q, k, v, layout.cu, layout.cu, m, m, **kwargs)
    pad = q.size(0) - layout.end
    return out if pad == 0 else F.pad(out[: layout.end], (0, 0, 0, 0, 0, pad))
