"""Which path runs causal attention over packed (THD) documents: the one place it is decided.

``PACKED_IMPLS`` (``ops.kernels.CHOICES["packed_attention"]``, ``LayerKernels.packed_attention``
given to each ``SDPAttention`` when the model is built):

* "varlen": :mod:`.varlen`, torch's ``varlen_attn`` (FlashAttention-2): one kernel per layer
  and direction whatever the document lengths; CUDA, 16-bit, no dropout, torch >= 2.10.
* "blocked": :mod:`.blocked`, one masked SDPA over fixed query blocks: a kernel count that does
  not grow with the distinct lengths either, on any device and dtype, at 3-6x the attention
  FLOPs of exact per-document attention on mixed lengths.
* "buckets": :mod:`.packed`, one SDPA per power-of-two length bucket (exact FLOPs up to 2x
  padding, but kernels and host work that grow with the distinct lengths, up to
  ``log2(longest) + 1`` buckets).
* "auto": documents of one length (one long document included) run as one causal SDPA over
  ``[N, L]`` (the "buckets" path's shortcut: torch's fastest kernel, cuDNN / flash, one call);
  others "varlen" where it runs, else "blocked". The choice and its reason are logged once per
  device, dtype and reason.

An explicit choice that cannot run is an error naming why (:func:`choose_packed_impl`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_grpo.megatron.attention.blocked import blocked_causal_attention
from megatron_grpo.megatron.attention.packed import (
    cached_layout,
    packed_causal_attention,
    static_max_len,
)
from megatron_grpo.megatron.attention.varlen import varlen_causal_attention, varlen_unavailable
from megatron_grpo.ops.kernels import CHOICES, check_choice

PACKED_IMPLS = CHOICES["packed_attention"]

_log = logging.getLogger(__name__)
_LOGGED: set[tuple] = set()


def _one_length(bounds: list[int]) -> bool:
    lens = {b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)}
    return len(lens) == 1 and min(lens) > 0


def choose_packed_impl(
    impl: str,
    q: torch.Tensor,
    k: torch.Tensor,
    dropout_p: float,
    params: PackedSeqParams | None = None,
) -> tuple[str, str]:
    """(the path ``impl`` means for ``q [T, n_q, d]``, ``k [T, n_kv, d]`` at ``dropout_p`` and
    the documents of ``params`` (None: not looked at), why).

    Static ``params`` (a captured forward, :func:`.packed.mark_static`) run "varlen": the other
    paths read the bounds on the host.

    Raises ``ValueError`` for an unknown ``impl`` or an explicit "varlen" that cannot run."""
    check_choice("packed_attention", impl)
    if static_max_len(params) is not None:
        why = (
            "chosen explicitly"
            if impl in ("blocked", "buckets")
            else varlen_unavailable(q, k, dropout_p)
        )
        if why is not None:
            raise ValueError(
                f"a captured forward's packed attention runs 'varlen' only; {impl!r} here: {why}"
            )
        return "varlen", "a captured forward: its bounds live on the device"
    if impl in ("blocked", "buckets"):
        return impl, "chosen explicitly"
    if (
        impl == "auto"
        and params is not None
        and cached_layout(params, "_grpo_one_length", q.device, _one_length)
    ):
        return "buckets", "documents of one length: one causal SDPA over [N, L]"
    why = varlen_unavailable(q, k, dropout_p)
    if impl == "varlen" and why is not None:
        raise ValueError(
            f"packed attention 'varlen' cannot run: {why} (choose 'blocked' or 'buckets')"
        )
    if why is None:
        return "varlen", "varlen_attn runs on these inputs"
    return "blocked", why


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    *,
    impl: str,
    sdpa: Callable[..., torch.Tensor],
    scale: float,
    dropout_p: float = 0.0,
    buckets: str = "plan_free",
) -> torch.Tensor:
    """Per-document causal attention ``q [T, n_q, d]``, ``k, v [T, n_kv, d]`` -> ``[T, n_q, d]``
    (zeros after the last bound) on the path ``impl`` (``PACKED_IMPLS``) picks.

    ``sdpa(q, k, v[, mask])``: the caller's SDPA on ``[B, n, S, d]`` batches (GQA, ``dropout_p``
    and ``scale`` applied) for "blocked" and "buckets"; ``buckets``: ``packed.BUCKETS``."""
    check_choice("attention", buckets, "packed attention buckets")
    path, why = choose_packed_impl(impl, q, k, dropout_p, params)
    if impl == "auto":
        key = (q.device.type, q.dtype, path, why)
        if key not in _LOGGED:
            _LOGGED.add(key)
            _log.info("packed attention 'auto' on %s %s: %s (%s)", *key)
    if path == "varlen":
        return varlen_causal_attention(q, k, v, params, scale=scale)
    if path == "blocked":
        return blocked_causal_attention(q, k, v, params, sdpa=sdpa)
    return packed_causal_attention(q, k, v, params, sdpa=sdpa, buckets=buckets)
