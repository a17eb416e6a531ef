"""megatron-core's all-to-all dispatcher with one host sync per layer: its token permutation by
sort, with a backward without atomics.

Without Transformer Engine (``moe_permute_fusion``) the dispatcher's first permutation
(``moe_utils.permute``) either selects each expert's tokens with ``masked_select`` on the
routing map, twice (tokens, probs), reading the output size back to the host each time (0.16),
or argsorts the whole ``[E, T]`` map (0.19); both then gather the rows with ``index_select``,
whose backward is an ``index_add`` with k-way atomic conflicts (on 4 H200s, 5% of the
Qwen3-30B-A3B layer shape's fwd+bwd at EP 4). :func:`sort_permute` is the same permutation
(expert-major, tokens ascending: the same rows, probs and ``sorted_indices``) from one stable
sort of the top-k expert ids on the device (``moe.permute.sort_by_expert``), and its backward
gathers each token's k rows (no atomics). The un-permutation (a scatter-add) never syncs and
stays megatron-core's. Token dropping, router padding and the fused kernels keep megatron-core's
own permute (:func:`sort_permute_applies`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from megatron_grpo.megatron.moe.permute import permute_tokens, sort_by_expert


def sort_permute_applies(
    tokens: Tensor, routing_map: Tensor, num_out_tokens, fused: bool, drop_and_pad: bool
) -> int | None:
    """The top-k of a dropless routing map (each row exactly k experts: ``num_out_tokens`` is
    the host int ``T * k``), or None where megatron-core's permute must run."""
    t = tokens.size(0)
    if fused or drop_and_pad or not isinstance(num_out_tokens, int) or t == 0:
        return None
    if num_out_tokens % t or not 0 < num_out_tokens // t <= routing_map.size(1):
        return None
    return num_out_tokens // t


def make_sort_permute(megatron_permute: Callable) -> Callable:
    """``moe_utils.permute``'s contract, by sort where :func:`sort_permute_applies`, else
    ``megatron_permute``. megatron-core >= 0.19's permute also takes ``tokens_per_expert`` /
    ``align_size`` and returns two more values (pad offsets, padded counts): None and the
    counts unchanged here (no padding)."""
    five = "tokens_per_expert" in inspect.signature(megatron_permute).parameters

    def sort_permute(
        tokens: Tensor,
        routing_map: Tensor,
        probs: Tensor | None = None,
        num_out_tokens=None,
        fused: bool = False,
        drop_and_pad: bool = False,
        **extra,
    ) -> tuple:
        """``tokens [T, H]``, ``routing_map [T, E]`` (k per row), ``probs [T, E]`` ->
        (``[T*k, H]`` expert-major, probs ``[T*k]``, the token of each row ``[T*k]``; with
        0.19's contract also None, ``tokens_per_expert``)."""
        k = sort_permute_applies(tokens, routing_map, num_out_tokens, fused, drop_and_pad)
        if k is None or extra.get("align_size", 0):
            return megatron_permute(
                tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad, **extra
            )
        ids = torch.topk(routing_map.to(torch.uint8), k, dim=1, sorted=False).indices
        order, inverse, _ = sort_by_expert(ids, routing_map.size(1))
        permuted = permute_tokens(tokens, order, inverse, k)
        permuted_probs = None
        if probs is not None:
            permuted_probs = probs.gather(1, ids).reshape(-1).index_select(0, order)
        out = (permuted, permuted_probs, torch.div(order, k, rounding_mode="floor"))
        return (*out, None, extra.get("tokens_per_expert")) if five else out

    sort_permute.megatron_permute = megatron_permute
    return sort_permute


def use_sort_permute() -> bool:
    """Install :func:`make_sort_permute` as the all-to-all dispatcher's ``permute`` (the name
    ``token_dispatcher`` imports from ``moe_utils``; 0.16.1 and 0.19.2); False when already
    installed. Installed by the first expert-parallel ``GroupedMoELayer``."""
    from megatron.core.transformer.moe import token_dispatcher

    current = token_dispatcher.permute
    if hasattr(current, "megatron_permute"):
        return False
    token_dispatcher.permute = make_sort_permute(current)
    return True
