"""The trained model's shards gathered into this rank's generation replica, on every rank.

``rollout.colocated.weights: replica`` (``rollout/replica.py``) gives each rank a TP = EP = 1
copy of the policy (``megatron/model/replica.py``). Before each rollout every rank all-gathers
the TP-sharded tensors over its TP group and the expert tensors over its expert group
(EP x expert-TP), in batches of at most ``BATCH_BYTES`` of shards, assembles the global tensors
(``shards``: the same rules as the weight sender's) and copies them into the replica's
parameters in place, so the replica's captured decode graphs stay valid.
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.rollout.weight_sync.sender import exchange_coords, expert_group, gather_tensors
from megatron_grpo.rollout.weight_sync.shards import Coords, SyncTensor, one_chunk, sync_tensors

BATCH_BYTES = 256 << 20  # shard bytes per all-gather (bounds the gathered buffer)


class ReplicaCopy:
    """``ReplicaCopy(trained, layout, replica)``; ``copy()`` whenever the trained weights changed.

    Args:
        trained: this rank's trained model chunk (wrapped or not; pipeline parallelism 1).
        layout: this rank's :class:`ParallelLayout` (the TP and expert groups).
        replica: this rank's TP = EP = 1 GPTModel of the same architecture.

    A collective (the TP and expert groups exchange their shard coordinates); a replica tensor
    whose shape is not the trained tensor's global shape is an error naming it (vocabulary rows
    excepted: each layout pads them for its own TP size, the shorter count is copied).
    """

    def __init__(
        self,
        trained: torch.nn.Module,
        layout: ParallelLayout,
        replica: torch.nn.Module,
    ) -> None:
        trained = one_chunk(trained)
        self.tensors: list[SyncTensor] = sync_tensors(trained)
        coords = Coords.of(trained, layout)
        device = self.tensors[0].params[0].device
        self.groups = {"tp": layout.tp_group, "expert": expert_group(trained, layout)}
        self.coords = {k: exchange_coords(g, coords, device) for k, g in self.groups.items()}
        self.shapes = [t.global_shape(coords) for t in self.tensors]
        self.targets = _match(self.tensors, self.shapes, sync_tensors(replica))

    @torch.no_grad()
    def copy(self) -> float:
        """Copy the trained weights in; returns the seconds it took (until the copies completed)."""
        t0 = time.perf_counter()
        for kind in ("replicated", "tp", "expert"):
            for batch in self._batches(kind):
                if kind == "replicated":
                    full = {i: self.tensors[i].local() for i in batch}
                else:
                    shapes = [self.shapes[i] for i in batch]
                    group, coords = self.groups[kind], self.coords[kind]
                    full = gather_tensors(self.tensors, batch, shapes, group, coords)
                for i, t in full.items():
                    _copy_into(self.targets[i], t)
        device = self.tensors[0].params[0].device
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0

    def _batches(self, kind: str) -> list[list[int]]:
        """The indices of ``kind``'s tensors, cut into runs of at most ``BATCH_BYTES`` of
        shards (a larger tensor alone)."""
        out: list[list[int]] = []
        size = BATCH_BYTES
        for i, t in enumerate(self.tensors):
            if t.kind != kind:
                continue
            n = math.prod(t.local_shape) * t.dtype.itemsize
            if not out or size + n > BATCH_BYTES:
                out.append([])
                size = 0
            out[-1].append(i)
            size += n
        return out


def _match(
    tensors: list[SyncTensor], shapes: list[tuple[int, ...]], replica: list[SyncTensor]
) -> list[SyncTensor]:
    """The replica's tensor of each trained tensor (by key), shapes checked."""
    mine = {t.key: t for t in replica}
    out = []
    for t, shape in zip(tensors, shapes, strict=True):
        r = mine.get(t.key)
        if r is None:
            raise ValueError(f"generation replica: no tensor {t.key} (trained model's) in it")
        skip = 1 if t.vocab else 0  # vocabulary rows: padded per TP size
        if tuple(r.local_shape[skip:]) != tuple(shape[skip:]):
            raise ValueError(
                f"generation replica: {t.key} is {tuple(r.local_shape)}, the trained model's "
                f"global tensor {tuple(shape)}"
            )
        out.append(r)
    if len(out) != len(mine):
        extra = sorted(set(mine) - {t.key for t in tensors})
        raise ValueError(f"generation replica: tensors the trained model lacks: {extra[:3]}")
    return out


def _copy_into(target: SyncTensor, full: Tensor) -> None:
    """``full`` (a global tensor) into the replica's parameter(s); vocabulary rows: as many as
    both hold (past them the replica's padding rows stay zero)."""
    rows = min(full.shape[0], target.local_shape[0])
    if target.stacked:
        for e, p in enumerate(target.params):
            p.copy_(full[e])
        return
    p = target.params[0]
    p[:rows].copy_(full[:rows])
    if rows < p.shape[0]:
        p[rows:].zero_()
