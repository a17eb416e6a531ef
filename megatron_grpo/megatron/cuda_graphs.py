"""CUDA graphs shared by the engine's decode steps and the trainer's log-prob passes: a cache of
captured graphs in one memory pool, and the allocator setting under which capture stalls.

A graph replays a whole forward as one launch: the host's per-kernel and per-module cost is paid
once, at capture. Inputs and outputs are static buffers owned by the caller; a step captured
here must not sync with the host (no ``.item()``, no data-dependent shapes).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Hashable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_grpo.megatron.parallel import all_reduce_max

# The allocator settings' environment variables (the second is torch >= 2.9's name).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments() -> str | None:
    """The variable that turns on the allocator's expandable segments (``NAME=value``), or None.

    Decode graph capture never finished with them on (2 x H200, torch 2.11 + CUDA 13: the
    first rollout of the dense twin stalled for minutes, and finished in seconds with them off
    or with graphs off), so the engine does not capture graphs under them."""
    for name in ALLOC_CONF_VARS:
        value = os.environ.get(name, "")
        for item in value.split(","):
            key, _, setting = item.partition(":")
            if key.strip() == "expandable_segments" and setting.strip().lower() == "true":
                return f"{name}={value}"
    return None


@contextlib.contextmanager
def rng_forks_skipped() -> Iterator[None]:
    """megatron-core's RNG tracker forks become no-ops inside the block.

    Its forward forks to the TP (or expert) RNG state around sequence-parallel regions and the
    experts; the default tracker swaps states by re-seeding the generator, which a capture
    refuses ("set_current_seed can be called during stream capture only if new seed is the
    same", the MoE twin at TP 2 + SP, 2 x H200). Nothing captured draws from those states:
    decode runs in eval mode, and the trainer's graphs refuse models with hidden dropout
    (``step.graph_plan``; attention dropout: varlen's check), so the swaps are skipped. A
    graph-safe tracker is left as it is."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    if getattr(tracker, "use_cudagraphable_rng", False):
        yield
        return
    own = vars(tracker).get("fork")  # a fork set on the instance, kept; else the class's
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        if own is None:
            del tracker.fork
        else:
            tracker.fork = own


def no_checkpoint() -> Callable[[], None]:
    """A step whose warm-up changes nothing it reads: nothing to restore."""
    return lambda: None


class GraphCache:
    """Captured graphs by key, all in one memory pool (only one runs at a time)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.captures = 0
        # One warm-up stream for every capture: cuBLAS keeps a workspace per stream it ran on
        # (tens of MiB each, never freed), so a new stream per capture would leave one each.
        self.side: torch.cuda.Stream | None = None

    @staticmethod
    def agree_recapture(changed: bool, groups: Iterable[dist.ProcessGroup | None]) -> bool:
        """Whether graphs are captured again, agreed over ``groups``: every group whose
        collectives the graphs hold (TP, the expert group). Capture runs the step eagerly first, so
        a rank re-capturing alone issues collectives its peers replay from a graph: they pair up
        wrongly and hang (a TP2 x DP2 run hung in its third rollout when one rank's cache moved and
        its TP peer's did not). Reduced group by group, which agrees across megatron-core's
        orthogonal layouts (each rank's expert group meets the same TP groups as its TP peers')."""
        for group in groups:
            if group is not None:
                changed = bool(all_reduce_max([int(changed)], group, torch.int64)[0])
        return changed

    def drop(self, key: Hashable) -> None:
        """Forget the graph of ``key`` (its memory stays in the pool for later captures; with
        the last graph gone the pool dies, and later captures get a new one)."""
        self.graphs.pop(key, None)
        if not self.graphs:
            self.pool = torch.cuda.graph_pool_handle()

    def run(
        self,
        key: Hashable,
        step: Callable[[], None],
        checkpoint: Callable[[], Callable[[], None]] = no_checkpoint,
    ) -> None:
        """Replay the graph of ``key``, capturing ``step`` (which writes static outputs) first;
        ``checkpoint()`` saves what the step's warm-up run changes and returns what restores
        it (called only when capturing)."""
        graph = self.graphs.get(key)
        if graph is None:
            self.warm_up(step, checkpoint)
            graph = self.graphs[key] = self.capture(step)
        graph.replay()

    def warm_up(
        self,
        step: Callable[[], None],
        checkpoint: Callable[[], Callable[[], None]] = no_checkpoint,
    ) -> None:
        """Run ``step`` once on the side stream before its capture (lazy initialisation,
        compilation, autotuning), its changes undone by ``checkpoint()``'s restore. The engine's
        warm-up K/V writes are the replay's, at the same positions."""
        if self.side is None:
            self.side = torch.cuda.Stream()
        side = self.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            restore = checkpoint()
            step()
            restore()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """A graph of ``step`` in the cache's pool (capturing runs nothing; warm up first)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), rng_forks_skipped():
            step()
        self.captures += 1
        return graph

    def clear(self) -> None:
        """Drop every graph and start a new pool (a pool dies with its last graph)."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()
