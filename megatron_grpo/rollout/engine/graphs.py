"""CUDA graphs of the decode step, one per (batch bucket, context bucket, sampling params).

Eager decoding through Megatron's modules is bound by Python and kernel launches (a batch-256
one-token forward of a 28-layer model: 36 ms eager, 5.5 ms replayed). A graph replays the whole
step: embedding, every layer with its KV-cache write and attention, the LM head, sampling and
the TP broadcast. Inputs and outputs are static buffers owned by the engine; the KV cache is
read at the address it had at capture, so graphs are keyed by that address too and captured
again only when the cache lands elsewhere (the caching allocator usually hands the same block
back on the next call). Weights updated in place by the optimizer stay valid.

All graphs share one memory pool: only one runs at a time.
"""

from __future__ import annotations

import torch

from megatron_grpo.megatron.cuda_graphs import (  # noqa: F401 (the engine's names, kept)
    ALLOC_CONF_VARS,
    GraphCache,
    expandable_segments,
)
from megatron_grpo.megatron.moe.local_dispatch import host_sync_reason


def plan_graphs(model: torch.nn.Module, requested: bool | None, cuda: bool) -> tuple[bool, str]:
    """Whether decode steps replay CUDA graphs (``rollout.engine.cuda_graphs``: None = auto), and
    why they are off where auto would have them on ("" otherwise; the start-up line says it).
    Auto: on for a model on GPU whose decode step never syncs with the host (megatron-core's
    MoE dispatchers do: data-dependent shapes) outside expandable segments. An explicit request
    that cannot be honoured is an error."""
    moe = None if model.config.num_moe_experts is None else host_sync_reason(model)
    if requested and (not cuda or moe):
        why = f"MoE: {moe}" if moe else "a GPU"
        raise ValueError(
            f"rollout.engine.cuda_graphs needs a model whose decode step never syncs with "
            f"the host on GPU, not {why}; set it to null (auto) or false"
        )
    expandable = expandable_segments() if cuda else None
    if requested and expandable:
        raise ValueError(
            f"rollout.engine.cuda_graphs: decode graphs do not capture with {expandable} "
            "(expandable segments); unset that setting or set cuda_graphs to null / false"
        )
    if requested is not None:
        return requested, ""
    if cuda and (moe or expandable):
        return False, f"off: {expandable}" if expandable else f"off: MoE {moe}"
    return cuda, ""


def graph_batch(rows: int, slots: int) -> int:
    """Decode batch of a CUDA graph: the next power of two, at most ``slots``."""
    return min(1 << (rows - 1).bit_length(), slots)


class DecodeGraphs(GraphCache):
    """The engine's decode-step graphs (re-captured only when every rank whose collectives they
    hold agrees: :meth:`GraphCache.agree_recapture`)."""
