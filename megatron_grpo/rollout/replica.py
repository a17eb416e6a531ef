"""``rollout.colocated.weights: replica``: each rank generates its share on its own full copy.

With the shared weights (the default) a tensor-parallel engine decodes every sample of its
model replica on every TP rank, each through its shards, plus the TP collectives of every
layer; at EP > 1 the MoE layers add their dispatch. At the batch sizes of RL rollouts (a few
hundred rows) launches and collectives take much of a decode step, so TP ranks shorten it far
less than they divide its work (the MoE twin's step is launch-bound). Here each rank
holds a TP = EP = 1 copy of the policy (``megatron/model/replica.py``), refreshed from the
trained shards before every call (``weight_sync/replica_copy.py``), and decodes only its share
of the samples: the TP group generates as data parallelism, with no collective per step. The
results are gathered over the TP group, so every rank returns the whole batch, as the shared
engine does. Each sample draws the uniform numbers it would draw in a single engine's call, so
the tokens are the ones one engine over all samples would sample (up to the rounding of other
batch shapes). The cost: one copy of the model per GPU (in the model dtype), refreshed each
call.

Partial rollouts (``rollout.partial``) run on it as streams: each rank of the TP group keeps its
own share of the DP rank's groups in flight and runs them with :meth:`ReplicaEngine.run_requests`
on its replica (``rollout.partial``'s module docstring).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.model.replica import build_replica
from megatron_grpo.rollout.engine import Generation, KVCacheEngine, SamplingParams
from megatron_grpo.rollout.engine.options import EngineOptions
from megatron_grpo.rollout.engine.requests import Request
from megatron_grpo.rollout.weight_sync.replica_copy import ReplicaCopy


def share(n: int, rank: int, size: int) -> tuple[int, int]:
    """The samples ``[lo, hi)`` of rank ``rank`` of ``size`` out of ``n`` (contiguous, the first
    ``n % size`` ranks one more)."""
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


class ReplicaEngine:
    """The engine of ``rollout.colocated.weights: replica`` (module docstring).

    Args:
        model: the trained policy (its unwrapped first chunk: what ``generate`` is called for).
        model_cfg: its architecture (``ModelConfig``): the replica is built from it.
        options, max_context: the replica's :class:`KVCacheEngine`'s (``rollout.engine``).

    A collective over the world when built (the replica's single-rank groups, the shard
    coordinates); ``generate`` is one over the TP and expert groups."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_cfg,
        options: EngineOptions | None = None,
        max_context: int | None = None,
    ) -> None:
        layout = ParallelLayout.current(model.config.sequence_parallel)  # the trainer's
        if layout.pp_size > 1 or layout.cp_size > 1:
            raise ValueError(
                "rollout.colocated.weights: replica needs pipeline_model_parallel_size and "
                f"context_parallel_size 1, got {layout.pp_size} and {layout.cp_size}"
            )
        self.model, self.layout = model, layout
        self.replica = build_replica(model_cfg)
        self.copier = ReplicaCopy(model, layout, self.replica)
        self.engine = KVCacheEngine(self.replica, options, max_context, layout=ParallelLayout())
        self.stats: dict[str, float] = {}

    @property
    def decode(self):
        return self.engine.decode

    @property
    def use_graphs(self) -> bool:
        return self.engine.use_graphs

    @property
    def graphs_off(self) -> str:
        return self.engine.graphs_off

    @property
    def sizer(self):
        return self.engine.sizer

    def describe(self) -> str:
        """The start-up line's part that says where generation runs."""
        nbytes = sum(p.numel() * p.element_size() for p in self.replica.parameters())
        return (
            f"on a TP=EP=1 replica per rank ({nbytes / 2**30:.2f} GiB), "
            f"{self.layout.tp_size} rank(s) of each TP group sharing its samples"
        )

    @property
    def stream(self) -> tuple[int, int]:
        """(this rank's stream, the streams of its TP group): the samples each rank generates
        on its own replica."""
        return self.layout.tp_rank, self.layout.tp_size

    @torch.no_grad()
    def run_requests(
        self,
        requests: list[Request],
        params: SamplingParams,
        version: int,
        stop: Callable[[torch.Tensor], bool] | None = None,
        keep_kv: bool = False,
        record_routes: bool = False,
        check_every: int | None = None,
    ) -> None:
        """:meth:`KVCacheEngine.run_requests` of this rank's own ``requests`` (its stream's) on
        its replica, refreshed from the trained shards first: the refresh is a collective over
        the TP and expert groups (every rank calls this once per rollout call), the decode
        steps hold none."""
        seconds = self.copier.copy()
        self.engine.run_requests(
            requests, params, version, stop, keep_kv, record_routes, check_every
        )
        self.stats = {**self.engine.stats, "replica_copy_seconds": seconds}

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator,
        record_routes: bool = False,
        limits: list[int | None] | None = None,
    ) -> Generation:
        """As :meth:`KVCacheEngine.generate`, on every rank of a TP group with the same
        arguments; returns every sample's result on every rank."""
        seconds = self.copier.copy()
        uniforms = torch.rand(len(prompts), params.max_new_tokens, generator=generator)
        rank, size = self.layout.tp_rank, self.layout.tp_size
        lo, hi = share(len(prompts), rank, size)
        mine = Generation([], [], [] if record_routes else None)
        if hi > lo:
            lim = None if limits is None else limits[lo:hi]
            mine = self.engine.generate(
                prompts[lo:hi], params, generator, record_routes, lim, uniforms=uniforms[lo:hi]
            )
        self.stats = {**(self.engine.stats if hi > lo else {}), "replica_copy_seconds": seconds}
        return _gathered(mine, self.layout.tp_group)


def _gathered(mine: Generation, group: dist.ProcessGroup | None) -> Generation:
    """Every TP rank's share, in rank order (the samples' order)."""
    if group is None:
        return mine
    parts: list = [None] * group.size()
    dist.all_gather_object(parts, mine, group=group)
    routes = None if mine.routes is None else [r for p in parts for r in p.routes]
    return Generation(
        [x for p in parts for x in p.responses], [x for p in parts for x in p.logprobs], routes
    )
