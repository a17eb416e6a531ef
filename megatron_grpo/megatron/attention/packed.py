"""Causal attention over packed (THD) documents without a per-document Python loop.

Documents are grouped by length (powers of two); each group is gathered into a right-padded
``[B, n, S, d]`` batch and run through one causal SDPA call. Each document attends causally to
itself only, and tokens after the last ``cu_seqlens`` bound (TP/SP padding) get zeros. Right
padding is exact under a causal mask: a real query only sees keys at or before it, all of them
real. Padding costs at most 2x a group's tokens; the number of SDPA calls is at most
``log2(longest document) + 1`` instead of one per document (a micro-batch of hundreds of short
rollouts would otherwise launch hundreds of attention kernels per layer).

RL micro-batches of mixed lengths bring new bucket shapes ``[B, n, S, d]`` in every
micro-batch, and cuDNN's SDPA (torch's first choice on Hopper) builds an execution plan per new
shape: 0.37 s per micro-batch of 20-600 token documents against 7 ms of attention on an H200
(tools/bench_packed_attention.py --mixed; rounding B and S to two sizes per power of two still
left 0.11 s, and doubled the attention). So the buckets (``BUCKETS``) run by default on the SDPA
backends that need no plan ("plan_free": flash, memory-efficient, math; as fast as cuDNN on
these short documents); "exact" leaves the choice to torch.

Documents of one length that tile the input (one long document, or equal ones) skip the gather:
the input is reshaped to ``[B, S, ...]``. The document layout (bounds, buckets, gather indices)
is computed once per ``PackedSeqParams`` and cached on it: every layer, and the recomputation in
backward, reuses it without a device-to-host sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.ops.kernels import CHOICES

# sdpa(q, k, v[, attn_mask]) on [B, n, S, d] batches: causal without a mask
SDPA = Callable[..., torch.Tensor]
# how the gathered buckets run (see the module docstring)
BUCKETS = CHOICES["attention"]
_PLAN_FREE = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _Buckets:
    """The gathered buckets of a micro-batch, as "slots": bucket after bucket, each ``B * S``
    slots row-major. Padding slots read token 0: right padding is only ever seen by padding
    queries under the causal mask, whose outputs are dropped (so no gradient reaches it)."""

    shapes: list[tuple[int, int]]  # (B, S) of each bucket
    sizes: list[int]  # B * S of each bucket
    slots: torch.Tensor  # [sum B * S] the token each slot reads
    source: torch.Tensor  # [end] the slot of each token before ``end`` (each slot once)


@dataclass
class DocumentLayout:
    """Where the documents of a packed micro-batch lie; built once per ``PackedSeqParams``."""

    end: int  # cu_seqlens[-1]: tokens at or after it are padding
    buckets: _Buckets | None
    # (B, S) when B documents of S tokens tile [0, end): q[:end] is then viewed as [B, S, ...]
    equal: tuple[int, int] | None


_HOST = "_grpo_host_bounds"
_STATIC = "_grpo_static_max_len"


def mark_static(params: PackedSeqParams, max_len: int) -> None:
    """The bounds of ``params`` live on the device only and change between forwards without a
    new ``params`` (the static inputs of a captured CUDA graph): the layouts read the device
    ``cu_seqlens_q`` in their kernels, take ``max_len`` as the longest document and never read
    bounds on the host (:func:`cached_layout` refuses)."""
    params.__dict__[_STATIC] = int(max_len)


def forget_forward_caches(params: PackedSeqParams) -> None:
    """Drop what the forwards cached on ``params`` (layouts, RoPE tables; not its host bounds
    or static mark): before a captured forward, so that the capture computes them from the
    static bounds instead of baking in a warm-up's values."""
    for name in [
        k for k in params.__dict__ if k.startswith("_grpo_") and k not in (_HOST, _STATIC)
    ]:
        del params.__dict__[name]


def static_max_len(params: PackedSeqParams | None) -> int | None:
    """The ``max_len`` of a :func:`mark_static` ``params`` (None: its bounds may be read)."""
    return None if params is None else params.__dict__.get(_STATIC)


def remember_host_bounds(params: PackedSeqParams, host: dict[str, torch.Tensor]) -> None:
    """Record ``host[name]``, the host tensor ``params.<name>`` was copied from: the layouts then
    read the bounds there, without a device-to-host sync (while neither copy is modified).
    ``params`` may be a copy with the same bound tensors (:func:`copy_host_bounds`)."""
    entries = {}
    for name, cpu in host.items():
        dev = getattr(params, name)
        entries[name] = (dev, dev._version, cpu, cpu._version)
    params.__dict__[_HOST] = entries


def copy_host_bounds(src: PackedSeqParams, dst: PackedSeqParams) -> None:
    """``dst`` (holding ``src``'s bound tensors) reads the host copies ``src`` recorded (or is
    static as ``src`` is)."""
    for name in (_HOST, _STATIC):
        if name in src.__dict__:
            dst.__dict__[name] = src.__dict__[name]


def _bounds(params: PackedSeqParams, cu: torch.Tensor) -> list[int]:
    for dev, version, cpu, cpu_version in params.__dict__.get(_HOST, {}).values():
        if dev is cu and (cu._version, cpu._version) == (version, cpu_version):
            return cpu.tolist()  # no sync
    return cu.tolist()  # the one device-to-host sync per micro-batch


def cached_layout(params: PackedSeqParams, name: str, device: torch.device, build):
    """``build(bounds)`` for ``params``' document bounds (the padded ones when given), cached on
    ``params`` under ``name``: every layer and the recompute in backward reuse it. The bounds
    are read from their host copy when one was recorded (:func:`remember_host_bounds`), else
    from the device (one sync per micro-batch and name).

    Valid while the bounds are the same tensor (held by the cache, so its id cannot be reused),
    not modified in place since (its version counter), and the device is the same. Static
    ``params`` (:func:`mark_static`) have no bounds to read: an error naming the layout."""
    if static_max_len(params) is not None:
        raise ValueError(
            f"{name.strip('_')}: a captured forward's bounds change between replays on the "
            "device, but this layout reads them on the host (only 'varlen' attention runs "
            "captured)"
        )
    cu = params.cu_seqlens_q_padded
    cu = params.cu_seqlens_q if cu is None else cu
    cached = getattr(params, name, None)
    if cached is not None and cached[0] is cu and cached[1:3] == (cu._version, device):
        return cached[3]
    layout = build(_bounds(params, cu))
    setattr(params, name, (cu, cu._version, device, layout))
    return layout


def document_layout(params: PackedSeqParams, device: torch.device) -> DocumentLayout:
    """The (cached) layout of ``params``' documents."""
    return cached_layout(params, "_grpo_document_layout", device, lambda b: _layout(b, device))


def _layout(bounds: list[int], device: torch.device) -> DocumentLayout:
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    lens = torch.tensor(bounds[1:], dtype=torch.long) - starts
    n = len(lens)
    equal = (n, bounds[-1] // n) if n and bool((lens == lens[0]).all()) and lens[0] > 0 else None
    buckets = None if equal else _buckets(starts, lens, bounds[-1], device)
    return DocumentLayout(end=bounds[-1], buckets=buckets, equal=equal)


def _buckets(starts: torch.Tensor, lens: torch.Tensor, end: int, device) -> _Buckets:
    """Documents grouped by ``ceil(log2(length))`` into right-padded ``[B, S]`` buckets. Built on
    the host: a boolean mask on the device would sync at every layer."""
    groups: dict[int, list[int]] = {}
    for doc, n in enumerate(lens.tolist()):
        if n > 0:
            groups.setdefault((n - 1).bit_length(), []).append(doc)
    shapes, slots = [], []
    source = torch.empty(end, dtype=torch.long)
    offset = 0
    for docs in groups.values():
        d = torch.tensor(docs)
        cols = torch.arange(int(lens[d].max()))
        valid = (cols[None, :] < lens[d, None]).flatten()
        tokens = (starts[d, None] + cols[None, :]).flatten()
        source[tokens[valid]] = offset + valid.nonzero().flatten()
        slots.append(torch.where(valid, tokens, 0))
        shapes.append((len(d), len(cols)))
        offset += len(d) * len(cols)
    sizes = [b * s for b, s in shapes]
    return _Buckets(
        shapes, sizes, host_to_device(torch.cat(slots), device), host_to_device(source, device)
    )


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    *,
    sdpa: SDPA,
    buckets: str = "plan_free",
) -> torch.Tensor:
    """Per-document causal attention: ``q [T, n_q, d]``, ``k, v [T, n_kv, d]`` -> ``[T, n_q, d]``.

    ``sdpa(q, k, v)`` is the caller's causal SDPA on ``[B, n, S, d]`` batches, with its GQA,
    dropout and softmax scale. ``buckets``: how documents of mixed lengths run (``BUCKETS``).
    """
    if buckets not in BUCKETS:
        raise ValueError(f"packed attention buckets must be one of {BUCKETS}, got {buckets!r}")
    layout = document_layout(params, q.device)
    if layout.equal is not None:  # e.g. one long document: no gather
        b, s = layout.equal
        qb, kb, vb = (
            x[: layout.end].reshape(b, s, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)
        )
        out = sdpa(qb, kb, vb).transpose(1, 2).reshape(layout.end, *q.shape[1:])
        pad = q.size(0) - layout.end
        return out if pad == 0 else torch.cat([out, out.new_zeros(pad, *out.shape[1:])])
    # One gather per input into every bucket's slots and one back: each backward is an
    # index_add whose only repeated index (token 0, read by padding) receives exact zeros.
    b = layout.buckets
    parts = [x.index_select(0, b.slots).split(b.sizes) for x in (q, k, v)]
    outs = []
    # the backward runs on the forward's backend: no context needed there
    with sdpa_kernel(_PLAN_FREE) if buckets == "plan_free" else contextlib.nullcontext():
        for (n, s), *qkv in zip(b.shapes, *parts, strict=True):
            # [B * S, h, d] -> [B, h, S, d]
            qb, kb, vb = (x.view(n, s, *x.shape[1:]).transpose(1, 2) for x in qkv)
            outs.append(sdpa(qb, kb, vb).transpose(1, 2).reshape(n * s, *q.shape[1:]))
    out = torch.cat(outs).index_select(0, b.source)
    pad = q.size(0) - layout.end
    return out if pad == 0 else torch.cat([out, out.new_zeros(pad, *out.shape[1:])])
