"""The generation ranks' loop: generate every unit assigned to this replica, with the weights of
its scheduled policy version, and ship it to its trainer ranks.

Each rank builds the policy at ``rollout.separate.tensor_model_parallel_size`` (its own
megatron-core layout over the generation sub-world), a :class:`WeightReceiver`, and the
:class:`~megatron_grpo.rollout.source.GeneratedRollouts` of a colocated run (same task,
prompts, sampling generators, engine and scorer); its engine keeps its KV cache (and so its
decode graphs) across calls: the GPU only generates. The next version is always being received
(``begin`` right after each ``swap``): its buckets are posted as soon as a check finds its header
arrived (between parts; with in-flight updates also every few decode steps), so the transfer
overlaps generation. A device synchronization meanwhile (a graph capture begins with one) waits
for the transfer at most, never for the trainer (``weight_sync.receiver``). A
swap happens only between parts of units (``parts``), when the next one is scheduled on a newer
version (``channel.unit_version``), and stops the generators for the copy alone; with
``rollout.separate.in_flight_updates`` also between engine steps, as soon as a newer version is
complete (``parts.run_in_flight``: requests continue under it). A version of
``STOP`` (the run's end) or ``STOPPED`` (the trainer stopped early on a stop request: a signal,
the time limit) ends the loop; :meth:`GenerationLoop.run` says which.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from megatron_grpo.megatron.config import ModelConfig, ParallelConfig
from megatron_grpo.megatron.model.build import build_model, unwrap
from megatron_grpo.megatron.parallel import all_reduce_max, initialize_parallel
from megatron_grpo.rollout.config import EvaluationConfig, RolloutConfig
from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.rollout.dynamic_sampling import FilteredRollouts
from megatron_grpo.rollout.evaluation import Evaluator, eval_due
from megatron_grpo.rollout.separate.channel import (
    Start,
    Unit,
    exchange_start,
    replica_of,
    send_eval,
    send_unit,
    unit_version,
)
from megatron_grpo.rollout.separate.parts import PartRounds, VersionsEnded
from megatron_grpo.rollout.separate.world import SOURCE, SeparateWorld
from megatron_grpo.rollout.source import GeneratedRollouts, build_checked_task
from megatron_grpo.rollout.tasks import Task
from megatron_grpo.rollout.weight_sync import WeightReceiver

STOP = -1  # the version the trainer sends last: no more weights, no more units
STOPPED = -2  # the same, sent when the trainer stopped early on a stop request


def ended(version: int | None) -> bool:
    """Whether ``version`` is one of the ends (``STOP``, ``STOPPED``)."""
    return version is not None and version < 0


class GenerationLoop:
    """One generation rank of a separate placement (module docstring); :meth:`run` to the end."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: RolloutConfig,
        ctx: RolloutContext,
        world: SeparateWorld,
        task: Task | None = None,
        evaluation: EvaluationConfig | None = None,
    ) -> None:
        """``task``: built and checked already, else built here. ``evaluation``: the run's
        ``evaluation:`` section (the replicas evaluate: ``separate/evaluation.py``)."""
        self.cfg, self.ctx, self.world = cfg, ctx, world
        moe_tp = world.tp > 1 and model_cfg.num_moe_experts is not None
        # MoE at TP > 1: the sequence-parallel path megatron-core's MoE layer is built for
        par = ParallelConfig(tensor_model_parallel_size=world.tp, sequence_parallel=moe_tp)
        self.layout = layout = initialize_parallel(par, ctx.seed)
        [chunk] = build_model(model_cfg, par, wrap_ddp=False)
        self.model = unwrap(chunk)
        self.model.eval()
        # Collective with the trainer's WeightSender, then the trainer's opening message.
        self.receiver = WeightReceiver(
            self.model, layout, world.sync_group, SOURCE, world.notice_group
        )
        self.start: Start = exchange_start(None, world.data_group)
        task = task if task is not None else build_checked_task(cfg, ctx)
        # the GPU only generates: the cache and its graphs stay (no release, no re-capture)
        cfg = replace(cfg, engine=replace(cfg.engine, keep_cache=True))
        self.gen = GeneratedRollouts(cfg, ctx, task, self.model, 0, self.start.dp_size)
        self.ranges = self.start.ranges(world.replicas)  # the parts of a unit
        self.evaluator = None
        if evaluation is not None and evaluation.enabled:  # the replicas as its DP ranks
            self.evaluator = Evaluator(evaluation, cfg, ctx, task, layout)
            self.evaluator.attach(self.model, self.gen)
        self.version: int | None = None
        self.in_flight = cfg.separate.in_flight_updates
        self.in_flight_swaps = 0
        self.receiving = False
        self.sends: list = []
        self.sync_metrics: dict[str, float] = {}

    def run(self) -> int:
        """Generate this replica's units; returns how many it generated (``self.version``:
        the end the trainer sent, ``STOP`` or ``STOPPED``)."""
        s, done = self.start, 0
        self._swap()  # the run's first weights: version ``start``
        k, parts = self.cfg.separate.max_staleness, len(self.ranges)
        for step in range(s.first_unit_step, s.steps):
            mine = [
                (d, j)
                for d in range(s.dp_size)
                for j in range(parts)
                if replica_of(step, d, j, s.dp_size, parts, self.world.replicas)
                == self.world.replica
            ]
            if not mine:
                continue
            t0 = time.perf_counter()
            need = unit_version(step, s.start, k)
            while not ended(self.version) and self.version < need:
                self._swap()
            if ended(self.version):
                break
            if self.version != need and not (self.in_flight and self.version > need):
                raise RuntimeError(
                    f"separate placement: step {step} is scheduled on policy version {need}, "
                    f"but the generators hold version {self.version}"
                )
            idle = time.perf_counter() - t0
            try:
                for d, j in mine:
                    self._unit(step, d, j, idle)
                    idle, done = 0.0, done + 1
            except VersionsEnded:  # the trainer's end came in flight: it waits for no more
                break
            self._receive()  # posts the next version's buckets once it has begun
        while not ended(self.version):  # the trainer's remaining versions, until it stops
            self._swap()
        self._finish_sends()
        return done

    def _swap(self) -> None:
        """Complete the version being received (begun now if not yet), copy it in and start
        receiving the next (its header: the buckets follow once the trainer sends it)."""
        if not self.receiving:
            self.receiver.begin()
        metrics = self.receiver.swap()
        self.version = int(metrics.pop("version"))
        self.sync_metrics = metrics
        self._evaluate()
        self.receiving = not ended(self.version)
        if self.receiving:
            self.receiver.begin()

    # ----------------------------------------------------------- in-flight updates (InFlight)
    def ready(self, finished: torch.Tensor) -> bool:
        """A newer version is complete on every rank of this replica (between engine steps)."""
        return self._receive()

    def _receive(self) -> bool:
        """Move the version being received on; whether it is complete on every rank of the
        replica. Its ranks post the buckets together, once the header reached all of them: a
        rank whose broadcast waited for a TP peer still decoding could block that peer's next
        TP collective at its next device synchronization."""
        r, group = self.receiver, self.layout.tp_group
        if self.layout.tp_size == 1:
            return r.poll()
        if not r.posted:  # agreed once per version; then only completion is
            [missing] = all_reduce_max([int(not r.arrived())], group, torch.int64)
            if missing:
                return False
            r.post()
        [missing] = all_reduce_max([int(not r.poll())], group, torch.int64)  # ranks pause together
        return not missing

    def swap(self) -> None:
        """Swap the complete version in mid-part; the trainer's end abandons the part."""
        self._swap()
        self.in_flight_swaps += 1
        if ended(self.version):
            raise VersionsEnded

    @torch.no_grad()
    def _evaluate(self) -> None:
        """Evaluate the weights just swapped in when due (the final ones come with ``STOP``);
        replica 0's first rank sends the result to every trainer rank."""
        v = self.start.steps if self.version == STOP else self.version
        s, e = self.start, self.evaluator
        if (
            e is None
            or self.version == STOPPED
            or not eval_due(v, s.steps, e.cfg.interval, s.start)
        ):
            return
        metrics = e.evaluate(v)
        if self.world.rank == self.world.replica_leaders()[0]:
            trainers = list(self.world.trainer_ranks)
            result = (metrics, e.summary(v, metrics))
            self.sends.append(send_eval(v, result, trainers, self.world.data_group))

    @torch.no_grad()
    def _unit(self, step: int, dp_rank: int, part: int, idle: float) -> None:
        """Generate and score part ``part`` of unit ``(step, dp_rank)``; the replica's first
        rank sends it."""
        t0 = time.perf_counter()
        lo, hi = self.ranges[part]
        version, swaps = self.version, self.in_flight_swaps
        flight = self if self.in_flight else None
        source = PartRounds(self.gen, dp_rank, lo, hi, version, flight)
        if self.cfg.filter_groups.enabled:  # this part's groups, filtered here alone
            source = FilteredRollouts(source, self.cfg.filter_groups, hi - lo, local=True)
        batch = source.next(step)
        counts = getattr(source, "counts", None)  # the filter's, summed by the trainer
        metrics = {
            **source.metrics(),
            "perf/generation_seconds": time.perf_counter() - t0,
            "perf/generator_idle_seconds": idle,
            "rollout/weight_swap_seconds": self.sync_metrics.get(
                "rollout/weight_swap_seconds", 0.0
            ),
        }
        if self.in_flight:  # versions swapped in while this part was generated
            metrics["rollout/in_flight_swaps"] = float(self.in_flight_swaps - swaps)
        if not self.world.is_leader:
            return
        unit = Unit(step, dp_rank, part, version, batch, metrics, counts)  # the version it began
        dsts, s = self.start.trainers_of(dp_rank), self.start
        self.sends.append(send_unit(unit, dsts, s.dp_size, len(self.ranges), self.world.data_group))
        self.sends = [s for s in self.sends if not all(w.is_completed() for w in s[0])]

    def _finish_sends(self) -> None:
        for works, *_ in self.sends:
            for w in works:
                w.wait()
        self.sends = []
