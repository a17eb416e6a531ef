"""CUDA graphs of the no-grad log-prob passes: one captured forward per micro-batch shape.

A forward of a packed micro-batch costs the host the same module code and kernel launches at 1k
tokens as at 32k, so passes of small micro-batches (or of small models) wait on the host. A
graph issues the whole decoder as one launch. Micro-batches are padded to a few shapes
(:mod:`~megatron_grpo.megatron.batch.graph_shape`), so a pass captures once per new shape and
replays the rest; the LM head runs eagerly on the graph's hidden states (its row selection
reads a count on the host) and the real tokens' log-probs are kept: on one H200 they equal the
eager pass's bit for bit (``tests/test_logprob_graphs.py``).

Scope: one pipeline stage, no context parallelism, every attention on ``varlen_attn`` (the only
packed path that reads its bounds on the device), MoE layers whose dispatch needs no host sync
(the local dispatch, or the gathered one at EP > 1, as in the engine's decode graphs).
:func:`~megatron_grpo.megatron.step.graph_plan.plan_logprob_graphs` is the one decision
(``training.logprob_cuda_graphs``: null = auto, on where the forward is host-bound).

Graphs are kept across steps (:class:`LogprobGraphs`, at most ``graph_store.MAX_GRAPHS``): a capture costs
about an eager forward's host time plus the graph's instantiation, so capturing in every call
made the passes slower (one H200, the 0.6B shape at 32k-token micro-batches: 94 -> 205 ms a
pass). The optimizer updates the weights in place; a model whose parameters or buffers moved is
captured again. Their memory pool (one forward's temporaries) stays reserved while they are kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.batch.graph_shape import graph_shapes, pad_to_shape
from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.megatron.batch.transport import full_logprobs
from megatron_grpo.megatron.cuda_graphs import no_checkpoint
from megatron_grpo.megatron.gpt import unwrap
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.moe.ep_dispatch import no_host_sync
from megatron_grpo.megatron.moe.routing_replay import (
    replay_routes,
    replay_stats_checkpoint,
    set_replay_routes,
)
from megatron_grpo.megatron.step.graph_store import GraphStore, routes_shape

# the LM head's log-probs of a micro-batch: (gpt, hidden [T_local, H], targets, rows, layout)
HeadLogprobs = Callable[..., Tensor]


class LogprobGraphs(GraphStore):
    """The captured forwards of a step's log-prob passes, kept across calls (a capture costs
    about an eager forward's host time, so it pays only when replayed again and again), at
    most ``limit`` (the least recently used go first), per model (:class:`GraphStore`)."""


def _run_one(
    graphs: LogprobGraphs, chunk, batch: PackedBatch, shape, routes, device
) -> tuple[Tensor, PackedBatch]:
    """Replay (capturing first if new) ``chunk``'s forward of ``batch`` padded to ``shape``;
    returns the static hidden states ``[T_local, H]`` and the padded batch."""
    key, static = graphs.static(chunk, shape, routes, device)
    padded = pad_to_shape(batch, shape)
    graphs.count(batch.num_tokens, shape)
    static.load(padded)
    checkpoint = no_checkpoint
    if static.routes is not None:
        set_replay_routes(chunk, static.routes)
        if key not in graphs.cache.graphs:  # counts allocated before capture, warm-up undone
            restore = replay_stats_checkpoint(chunk, device)
            checkpoint = lambda: restore  # noqa: E731
    graphs.cache.run(key, lambda: static.forward(chunk), checkpoint)
    return static.hidden, padded


def graphed_logprob_passes(
    chunk: torch.nn.Module,
    batches: list[PackedBatch],
    head: HeadLogprobs,
    layout: ParallelLayout,
    graphs: LogprobGraphs,
    count_group: dist.ProcessGroup | None = None,
) -> list[Tensor]:
    """Log-probs ``[T]`` (float32, CPU) of each of ``batches`` under ``chunk`` (in eval mode,
    no grad), each forward replayed from the graph of its shape. ``head``: the step's LM-head
    log-probs; ``count_group``: as in :meth:`GRPOStep.compute_logprobs` (its ranks agree on
    each forward's shape and on captures)."""
    gpt = unwrap(chunk)
    device = next(gpt.parameters()).device
    for b in batches:
        b.validate()
    routes = routes_shape(batches)
    graphs.before_replays(chunk, [layout.tp_group, count_group])
    reuse = graphs.reuse(chunk, routes)
    shapes = graph_shapes(batches, layout.token_multiple, count_group, reuse=reuse)
    out = []
    replay = replay_routes(chunk) if routes is not None else contextlib.nullcontext()
    with no_host_sync(chunk), replay:
        for batch, shape in zip(batches, shapes, strict=True):
            hidden, padded = _run_one(graphs, chunk, batch, shape, routes, device)
            rows, targets = (host_to_device(x, device) for x in (padded.loss_mask, padded.targets))
            logp = head(gpt, hidden, targets, rows, layout)
            out.append(full_logprobs(logp[: batch.num_tokens], batch, layout))
    return out
