"""Captured graphs kept per model and micro-batch shape: the static inputs they read, the
least recently used dropped first, and a model whose parameters or buffers moved captured again.
Shared by the log-prob passes' graphs (:mod:`.logprob_graphs`) and the update's
(:mod:`.update_graphs`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.attention.packed import forget_forward_caches, mark_static
from megatron_grpo.megatron.batch.graph_shape import MAX_SHAPES, GraphShape, ShapeReuse
from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.megatron.batch.transport import forward_tokens
from megatron_grpo.megatron.cuda_graphs import GraphCache
from megatron_grpo.megatron.gpt import unwrap
from megatron_grpo.megatron.step.graph_plan import capture_padding_tokens

# captured shapes kept per store (each holds its static inputs and hidden states)
MAX_GRAPHS = 16


def shape_budget(calls: int) -> int:
    """Shapes each of a step's ``calls`` (e.g. update schedules) may take so that the step's
    shapes fit one store: ``MAX_SHAPES`` at most, fewer past ``MAX_GRAPHS / MAX_SHAPES`` calls
    (more would capture every shape again in every step)."""
    return max(1, min(MAX_SHAPES, MAX_GRAPHS // max(calls, 1)))


@dataclass
class StaticBatch:
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


def routes_shape(batches: list[PackedBatch]) -> tuple[int, int] | None:
    """The ``[L, k]`` of the micro-batches' replayed routes (None: none carry routes)."""
    shapes = {tuple(b.routes.shape[1:]) for b in batches if b.routes is not None}
    if len(shapes) > 1:
        raise ValueError(f"the micro-batches' routes differ in [L, k]: {sorted(shapes)}")
    return shapes.pop() if shapes else None


def finish_param_gathers(chunk: torch.nn.Module) -> None:
    """Wait for megatron-core's overlapped parameter all-gathers of ``chunk`` (the distributed
    optimizer with ``overlap_param_gather`` leaves its updated shards to be gathered by DDP's
    forward pre-hooks, module by module), starting those not started: a replayed graph runs
    no hooks and would read the parameters of the step before. A no-op without them."""
    ddp = getattr(chunk, "ddp_config", None)
    if ddp is None or not getattr(ddp, "overlap_param_gather", False):
        return
    groups = [*chunk.bucket_groups, *getattr(chunk, "expert_parallel_bucket_groups", [])]
    for group in groups:  # each waited for in turn; none starts the next (all are here)
        group.finish_param_sync(skip_next_bucket_dispatch=True)


def model_addresses(chunk: torch.nn.Module) -> tuple[int, ...]:
    """Where ``chunk``'s parameters and buffers live: a captured forward reads them there
    (the module's: megatron-core's DDP wrapper has a ``buffers`` attribute of its own)."""
    gpt = unwrap(chunk)
    return tuple(t.data_ptr() for t in (*gpt.parameters(), *gpt.buffers()))


class GraphStore:
    """Static inputs by (model, shape, routes), at most ``limit`` (the least recently used go
    first), and their graphs in one :class:`GraphCache` (one pool: one graph runs at a time).
    A model whose parameters or buffers moved since its capture is captured again, agreed over
    the ranks whose collectives the graphs hold. :meth:`clear` drops them all (the pool goes
    with them)."""

    def __init__(self, limit: int = MAX_GRAPHS) -> None:
        self.limit = limit
        self.cache: GraphCache | None = None
        self.statics: OrderedDict[tuple, StaticBatch] = OrderedDict()
        self.addresses: dict[int, tuple[int, ...]] = {}
        self._captured = 0  # by the caches :meth:`clear` dropped
        self._tokens = [0, 0]  # (real, replayed) tokens since :meth:`padding` was last read

    @property
    def captures(self) -> int:
        """Graphs captured so far, across :meth:`clear`."""
        return self._captured + (0 if self.cache is None else self.cache.captures)

    def count(self, real: int, shape: GraphShape) -> None:
        """A micro-batch of ``real`` tokens ran padded to ``shape``."""
        self._tokens[0] += real
        self._tokens[1] += shape.tokens

    def padding(self) -> float | None:
        """The padding's share of the tokens run since the last call (None: none ran)."""
        real, run = self._tokens
        self._tokens = [0, 0]
        return None if run == 0 else 1.0 - real / run

    def clear(self) -> None:
        self._captured = self.captures
        self.statics.clear()
        self.addresses.clear()
        self.cache = None

    def before_replays(self, chunk: torch.nn.Module, groups: list) -> None:
        """Before a pass replays ``chunk``'s graphs: its parameters gathered
        (:func:`finish_param_gathers`), its graphs dropped if it moved (:meth:`check_model`)."""
        finish_param_gathers(chunk)
        self.check_model(chunk, groups)

    def check_model(self, chunk: torch.nn.Module, groups: list) -> None:
        """Drop ``chunk``'s graphs if its parameters or buffers moved on any rank of ``groups``."""
        now = self.addresses_of(chunk)
        moved = self.addresses.get(id(chunk), now) != now
        if GraphCache.agree_recapture(moved, groups):
            for key in [k for k in self.statics if k[0] == id(chunk)]:
                self._evict(key)
        self.addresses[id(chunk)] = now

    def addresses_of(self, chunk: torch.nn.Module) -> tuple[int, ...]:
        """Where ``chunk``'s graphs read (and write): its parameters and buffers."""
        return model_addresses(chunk)

    def reuse(self, chunk: torch.nn.Module, routes, backward: bool = False) -> ShapeReuse:
        """The shapes of ``chunk``'s graphs (with ``routes``) a new shape may give way to, and
        the padding a capture is worth (``backward``: the update's fwd+bwd)."""
        shapes = tuple(k[1] for k in self.statics if k[0] == id(chunk) and k[2] == routes)
        return ShapeReuse(shapes, capture_padding_tokens(unwrap(chunk), backward))

    def static(self, chunk, shape: GraphShape, routes, device) -> tuple[tuple, StaticBatch]:
        """The key and static buffers of ``chunk``'s forward of ``shape`` (made if new)."""
        if self.cache is None:
            self.cache = GraphCache()
        key = (id(chunk), shape, routes)
        if key not in self.statics:
            while len(self.statics) >= self.limit:
                self._evict(next(iter(self.statics)))
            self.statics[key] = StaticBatch.new(shape, device, routes)
        self.statics.move_to_end(key)
        return key, self.statics[key]

    def _evict(self, key: tuple) -> None:
        self.statics.pop(key)
        self.cache.drop(key)
