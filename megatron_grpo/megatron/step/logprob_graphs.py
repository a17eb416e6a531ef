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

Graphs are kept across steps (:class:`LogprobGraphs`, at most ``MAX_GRAPHS``): a capture costs
about an eager forward's host time plus the graph's instantiation, so capturing in every call
made the passes slower (one H200, the 0.6B shape at 32k-token micro-batches: 94 -> 205 ms a
pass). The optimizer updates the weights in place; a model whose parameters or buffers moved is
captured again. Their memory pool (one forward's temporaries) stays reserved while they are kept.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.attention.packed import forget_forward_caches, mark_static
from megatron_grpo.megatron.batch.graph_shape import GraphShape, graph_shapes, pad_to_shape
from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.megatron.batch.transport import forward_tokens, full_logprobs
from megatron_grpo.megatron.cuda_graphs import GraphCache, no_checkpoint
from megatron_grpo.megatron.gpt import unwrap
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.moe.ep_dispatch import no_host_sync
from megatron_grpo.megatron.moe.routing_replay import (
    replay_routes,
    replay_stats_checkpoint,
    set_replay_routes,
)

# captured forwards kept per step (each holds its static inputs and hidden states)
MAX_GRAPHS = 16
# the LM head's log-probs of a micro-batch: (gpt, hidden [T_local, H], targets, rows, layout)
HeadLogprobs = Callable[..., Tensor]


@dataclass
class _Static:
    """The static inputs and output of one shape's captured forward."""

    tokens: Tensor  # [1, T] int64
    positions: Tensor  # [1, T] int64
    params: PackedSeqParams  # cu_seqlens [S + 1] int32, marked static
    routes: Tensor | None  # [T, L, k] int64 (routing replay)
    hidden: Tensor | None = None  # the last forward's output (the graph's, once captured)

    @classmethod
    def new(cls, shape: GraphShape, device: torch.device, routes: tuple[int, int] | None):
        t = shape.tokens
        cu = torch.zeros(shape.docs + 1, dtype=torch.int32, device=device)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=shape.max_len,
            max_seqlen_kv=shape.max_len,
        )
        mark_static(params, shape.max_len)
        long = dict(dtype=torch.long, device=device)
        r = None if routes is None else torch.full((t, *routes), -1, **long)
        return cls(torch.zeros(1, t, **long), torch.zeros(1, t, **long), params, r)

    def load(self, batch: PackedBatch) -> None:
        """Copy a padded micro-batch into the static inputs (no routes: live routing)."""
        device = self.tokens.device
        self.tokens[0].copy_(host_to_device(batch.tokens, device))
        self.positions[0].copy_(host_to_device(batch.position_ids, device))
        self.params.cu_seqlens_q.copy_(host_to_device(batch.cu_seqlens.to(torch.int32), device))
        if self.routes is not None:
            if batch.routes is None:
                self.routes.fill_(-1)
            else:
                self.routes.copy_(host_to_device(batch.routes, device))

    def forward(self, chunk: torch.nn.Module) -> None:
        # Whatever a forward caches from its inputs must be computed inside the capture, not
        # read from the warm-up's run: the RoPE tables cached on the params (the first GPU run
        # replayed every micro-batch with its capture's positions), and megatron-core's rotary
        # table, which an lru_cache would otherwise hold outside the graph's pool (and may free).
        forget_forward_caches(self.params)
        rotary = getattr(unwrap(chunk), "rotary_pos_emb", None)
        clear = getattr(getattr(type(rotary), "forward", None), "cache_clear", None)
        if clear is not None:
            clear()
        self.hidden = forward_tokens(chunk, self.tokens, self.positions, self.params)


def _routes_shape(batches: list[PackedBatch]) -> tuple[int, int] | None:
    shapes = {tuple(b.routes.shape[1:]) for b in batches if b.routes is not None}
    if len(shapes) > 1:
        raise ValueError(f"the micro-batches' routes differ in [L, k]: {sorted(shapes)}")
    return shapes.pop() if shapes else None


def _addresses(chunk: torch.nn.Module) -> tuple[int, ...]:
    """Where ``chunk``'s parameters and buffers live: a captured forward reads them there
    (the module's: megatron-core's DDP wrapper has a ``buffers`` attribute of its own)."""
    gpt = unwrap(chunk)
    return tuple(t.data_ptr() for t in (*gpt.parameters(), *gpt.buffers()))


class LogprobGraphs:
    """The captured forwards of a step's log-prob passes, kept across calls (a capture costs
    about an eager forward's host time, so it pays only when replayed again and again), at
    most ``limit`` (the least recently used go first), per model. A model whose parameters or
    buffers moved since its capture is captured again, agreed over the ranks whose collectives
    the graphs hold. :meth:`clear` drops them all (their memory pool goes with them)."""

    def __init__(self, limit: int = MAX_GRAPHS) -> None:
        self.limit = limit
        self.cache: GraphCache | None = None
        self.statics: OrderedDict[tuple, _Static] = OrderedDict()
        self.addresses: dict[int, tuple[int, ...]] = {}

    def clear(self) -> None:
        self.statics.clear()
        self.addresses.clear()
        self.cache = None

    def check_model(self, chunk: torch.nn.Module, groups: list) -> None:
        """Drop ``chunk``'s graphs if its parameters or buffers moved on any rank of ``groups``."""
        now = _addresses(chunk)
        moved = self.addresses.get(id(chunk), now) != now
        if GraphCache.agree_recapture(moved, groups):
            for key in [k for k in self.statics if k[0] == id(chunk)]:
                self._evict(key)
        self.addresses[id(chunk)] = now

    def static(self, chunk, shape: GraphShape, routes, device) -> tuple[tuple, _Static]:
        """The key and static buffers of ``chunk``'s forward of ``shape`` (made if new)."""
        if self.cache is None:
            self.cache = GraphCache()
        key = (id(chunk), shape, routes)
        if key not in self.statics:
            while len(self.statics) >= self.limit:
                self._evict(next(iter(self.statics)))
            self.statics[key] = _Static.new(shape, device, routes)
        self.statics.move_to_end(key)
        return key, self.statics[key]

    def _evict(self, key: tuple) -> None:
        self.statics.pop(key)
        self.cache.drop(key)


def _run_one(
    graphs: LogprobGraphs, chunk, batch: PackedBatch, shape, routes, device
) -> tuple[Tensor, PackedBatch]:
    """Replay (capturing first if new) ``chunk``'s forward of ``batch`` padded to ``shape``;
    returns the static hidden states ``[T_local, H]`` and the padded batch."""
    key, static = graphs.static(chunk, shape, routes, device)
    padded = pad_to_shape(batch, shape)
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
    shapes = graph_shapes(batches, layout.token_multiple, count_group)
    routes = _routes_shape(batches)
    graphs.check_model(chunk, [layout.tp_group, count_group])
    out = []
    replay = replay_routes(chunk) if routes is not None else contextlib.nullcontext()
    with no_host_sync(chunk), replay:
        for batch, shape in zip(batches, shapes, strict=True):
            hidden, padded = _run_one(graphs, chunk, batch, shape, routes, device)
            rows, targets = (host_to_device(x, device) for x in (padded.loss_mask, padded.targets))
            logp = head(gpt, hidden, targets, rows, layout)
            out.append(full_logprobs(logp[: batch.num_tokens], batch, layout))
    return out
