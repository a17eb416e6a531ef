"""The trainer ranks' side of a separate placement: a rollout source fed by the generators, and
the weight push after every update.

:class:`SeparateRollouts` is the trainer's ``RolloutSource``: ``next(step)`` receives unit
``(step, dp_rank)`` (blocking: ``perf/trainer_wait_seconds``), checks every token's policy
version against ``max_staleness`` (groups that lag more are dropped and counted:
``rollout/stale_dropped_groups``) and returns it. :meth:`push` sends the new weights after the
step's update (the last step sends ``STOP`` instead). Checkpoints hold the units in flight (those
the generators make from weights the trainer already sent): a resume trains on them exactly as
the uninterrupted run would have, or, without them, generates them again with the checkpoint's
weights (said in one line).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.parallel import all_reduce_max, all_reduce_sum
from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.config import RolloutConfig
from megatron_grpo.rollout.dynamic_sampling import filter_metrics
from megatron_grpo.rollout.separate.channel import (
    Start,
    Unit,
    exchange_start,
    recv_unit,
    replica_of,
    unit_version,
)
from megatron_grpo.rollout.separate.generation import STOP, STOPPED, ended
from megatron_grpo.rollout.separate.world import SOURCE, SeparateWorld
from megatron_grpo.rollout.weight_sync import WeightSender


def drop_stale(unit: Unit, step: int, max_staleness: int) -> tuple[RolloutBatch, int]:
    """The unit's batch without the groups holding a token more than ``max_staleness``
    versions older than ``step``; returns it and the number of groups dropped."""
    b = unit.batch
    versions = b.policy_versions or [[unit.version] * len(r) for r in b.response_ids]
    stale = {
        g for g, vs in zip(b.group_ids, versions, strict=True) if step - min(vs) > max_staleness
    }
    if not stale:
        return b, 0
    keep = [i for i, g in enumerate(b.group_ids) if g not in stale]
    return b.select(keep), len(stale)


class SeparateRollouts:
    """The rollout source of a trainer rank under ``rollout.placement: separate``."""

    generated = True

    def __init__(
        self,
        cfg: RolloutConfig,
        model: torch.nn.Module,
        layout: ParallelLayout,
        world: SeparateWorld,
        steps: int,
    ) -> None:
        self.cfg, self.layout, self.world, self.steps = cfg, layout, world, steps
        self.k = cfg.separate.max_staleness
        self.sender = WeightSender(
            model, layout, world.sync_group, SOURCE, notice_group=world.notice_group
        )
        self.held: dict[int, Unit] = {}  # received, not trained on yet (by step)
        self.sent: int | None = None  # the last version pushed (STOP: finished)
        self.start: Start | None = None
        self._metrics: dict[str, float] = {}
        self._sync: dict[str, float] = {}
        self._dropped = 0

    # ------------------------------------------------------------------ set-up
    def open(self, start: int, saved: dict | None) -> str | None:
        """After the checkpoint loaded (``start``: its step, 0 for a fresh run): take the saved
        units in flight (``saved``, this rank's :meth:`state_dict`), tell the generators what to
        make and send them the weights. Returns the resume's one line (None: a fresh run)."""
        units = [u for u in (saved or {}).get("units", []) if u.step >= start]
        self.held, dropped = {}, 0
        for u in units:
            batch, n = drop_stale(u, u.step, self.k)
            if n:  # saved under a larger max_staleness: made again below
                dropped += n
                continue
            self.held[u.step] = u
        first = start
        while first in self.held and first < self.steps:
            first += 1
        [neg] = all_reduce_max([-float(first)], None)  # every trainer rank: the same
        first = int(-neg)
        self.held = {s: u for s, u in self.held.items() if s < first}
        self._dropped = dropped  # counted in the first step's rollout/stale_dropped_groups
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.layout.dp_rank)
        groups = self.cfg.num_prompts // self.layout.dp_size
        info = Start(start, first, self.steps, self.layout.dp_size, list(gathered), groups)
        self.start = exchange_start(info if dist.get_rank() == 0 else None, self.world.data_group)
        self._push(start)
        if saved is None and start == 0:
            return None
        made = f"steps {first}.." if first < self.steps else "none"
        if saved is None:
            return (
                f"resume: the checkpoint holds no in-flight rollouts (a run of another placement "
                f"or world size): the generators make those of steps {made} with the weights of "
                f"step {start}"
            )
        return (
            f"resume: {first - start} step(s) of in-flight rollouts continue from the checkpoint"
            + (f", {dropped} stale group(s) dropped" if dropped else "")
            + f"; the generators make {made}"
        )

    # ------------------------------------------------------------------ the source
    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def next(self, step: int) -> RolloutBatch:
        t0 = time.perf_counter()
        unit = self.held.pop(step, None) or self._recv(step)
        wait = time.perf_counter() - t0
        batch, dropped = drop_stale(unit, step, self.k)
        if not len(batch):
            raise RuntimeError(
                f"separate placement: every group of step {step} lags more than "
                f"rollout.separate.max_staleness={self.k} versions"
            )
        lags = [step - v for vs in batch.policy_versions or [] for v in vs] or [0]
        filtered = {}
        if unit.counts is not None:  # rollout.filter_groups: every part and DP rank's counts
            counts = all_reduce_sum(unit.counts, self.layout.dp_group)
            filtered = filter_metrics(counts, unit.metrics.get("rollout/filter_rounds", 1.0))
        self._metrics = {
            **unit.metrics,
            **filtered,
            **self._sync,
            "perf/trainer_wait_seconds": wait,
            "rollout/policy_lag_mean": sum(lags) / len(lags),
            "rollout/policy_lag_max": float(max(lags)),
            "rollout/stale_dropped_groups": float(dropped + self._dropped),
        }
        self._dropped = 0
        return batch

    def _recv(self, step: int) -> Unit:
        """Unit ``(step, dp_rank)``: its parts from their replicas, joined."""
        s, d, w = self.start, self.layout.dp_rank, self.world
        assert s is not None, "SeparateRollouts.open first"
        n = len(s.ranges(w.replicas))
        got = []
        for j in range(n):
            leader = w.replica_leaders()[replica_of(step, d, j, s.dp_size, n, w.replicas)]
            got.append(recv_unit((step, d, j), s.dp_size, n, leader, w.data_group))
        metrics = {k: max(u.metrics[k] for u in got) for k in got[0].metrics}
        batch = RolloutBatch.concat([u.batch for u in got])
        parts = [u.counts for u in got]
        counts = None if parts[0] is None else [sum(c) for c in zip(*parts, strict=True)]
        return Unit(step, d, 0, min(u.version for u in got), batch, metrics, counts)

    # ------------------------------------------------------------------ weights
    def push(self, step: int) -> dict[str, float]:
        """After step ``step``'s update: its weights (version ``step + 1``) to the generators,
        or, after the last step, ``STOP``."""
        return self._push(step + 1 if step + 1 < self.steps else STOP)

    def _push(self, version: int) -> dict[str, float]:
        if ended(self.sent):
            return {}
        self._sync = self.sender.send(version)
        self.sent = version
        return dict(self._sync)

    def _in_flight(self, next_step: int) -> list[int]:
        """Steps >= ``next_step`` the generators make (or made) from the weights sent so far
        and the trainer has not received yet."""
        s = self.start
        if s is None or self.sent is None or ended(self.sent):
            return []
        return [
            step
            for step in range(max(next_step, s.first_unit_step), self.steps)
            if step not in self.held and unit_version(step, s.start, self.k) <= self.sent
        ]

    def receive_in_flight(self, next_step: int) -> None:
        """Receive every unit the generators will make from the weights sent so far (steps >=
        ``next_step``): for a checkpoint, and before ``STOP``."""
        for step in self._in_flight(next_step):
            self.held[step] = self._recv(step)

    def state_dict(self, next_step: int) -> dict:
        """The units in flight at a checkpoint after ``next_step`` steps."""
        self.receive_in_flight(next_step)
        return {"units": [u for s, u in sorted(self.held.items()) if s >= next_step]}

    def close(self, next_step: int, stopped: bool = False) -> None:
        """End of the run (or a stop before ``next_step``): take what the generators still make,
        then ``STOP`` (``stopped``: ``STOPPED``, so the generation ranks exit as the trainer
        does on a stop request)."""
        if not ended(self.sent):
            self.receive_in_flight(next_step)
            self._push(STOPPED if stopped else STOP)


def separate_source(source: object) -> SeparateRollouts | None:
    """The :class:`SeparateRollouts` behind ``source`` (through wrappers), or None."""
    while source is not None:
        if isinstance(source, SeparateRollouts):
            return source
        source = getattr(source, "inner", None)
    return None
