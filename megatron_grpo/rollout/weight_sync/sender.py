"""The trainer's side: gather each bucket's tensors from the TP / EP shards, broadcast it.

Every trainer rank builds a :class:`WeightSender` (a collective: it exchanges the shard
coordinates within its TP and expert groups, and the source sends the bucket plan to the
generators) and calls :meth:`WeightSender.send` after each optimizer step, once the model's
parameters are complete (with the distributed optimizer's overlapped parameter all-gather, after
it finished). The ranks of the source's TP group gather the dense TP-sharded tensors, those of
its expert group (EP x expert-TP) the expert tensors, one ``all_gather`` per bucket and kind;
the source assembles them into global tensors and broadcasts the bucket to every generator
rank over ``sync_group``. Other trainer ranks (other data-parallel replicas) return at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.rollout.weight_sync.plan import ALIGN, TensorMeta, plan_buckets
from megatron_grpo.rollout.weight_sync.shards import (
    EXPERT_MODULES,
    Coords,
    SyncTensor,
    one_chunk,
    sync_tensors,
)

DEFAULT_BUCKET_BYTES = 512 << 20
GIB = float(1 << 30)


@dataclass
class _Gather:
    """One kind of sharded tensor ("tp" or "expert"): its group (None: size 1) and the coords
    of each group rank; ``member``: this rank gathers for the source."""

    group: dist.ProcessGroup | None
    coords: list[Coords]
    member: bool


def header_tensor(group: dist.ProcessGroup, device: torch.device) -> Tensor:
    """The one-element version header, where ``group``'s backend takes it (gloo: the CPU)."""
    on = torch.device("cpu") if dist.get_backend(group) == "gloo" else device
    return torch.zeros(1, dtype=torch.int64, device=on)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def as_bytes(t: Tensor) -> Tensor:
    """A contiguous tensor's bytes, flat uint8 (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def bytes_as(buf: Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """The ``shape`` tensor of ``dtype`` at byte ``offset`` of the uint8 ``buf`` (a view)."""
    n = math.prod(shape) * dtype.itemsize
    return buf[offset : offset + n].view(dtype).view(shape)


def expert_group(model: torch.nn.Module, layout: ParallelLayout) -> dist.ProcessGroup | None:
    """The group whose ranks hold one copy of every expert: EP x expert-TP (None: size 1)."""
    if layout.ep_size > 1:
        return layout.expert_tp_ep_group
    for module in model.modules():
        if isinstance(module, EXPERT_MODULES):
            group = module.tp_group
            return group if group.size() > 1 else None
    return None


def exchange_coords(group: dist.ProcessGroup | None, coords: Coords, device) -> list[Coords]:
    """The coords of every rank of ``group`` (in group-rank order)."""
    if group is None:
        return [coords]
    mine = torch.tensor([*coords.tp, *coords.ep, *coords.etp], dtype=torch.int64, device=device)
    out = torch.empty(group.size() * 6, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    rows = out.view(-1, 6).tolist()
    return [Coords(tuple(r[0:2]), tuple(r[2:4]), tuple(r[4:6])) for r in rows]


class WeightSender:
    """``WeightSender(model, layout, sync_group, source)``; ``send(version)`` after each update.

    Args:
        model: this trainer rank's model chunk (wrapped or not; pipeline parallelism 1).
        layout: this rank's :class:`ParallelLayout` (TP and EP groups).
        sync_group: a group of ``source`` and every generator rank (only the source uses it).
        source: the global rank that sends (a trainer rank; every trainer rank passes the same).
        bucket_bytes: bytes per broadcast (module docstring of ``plan``).
        notice_group: the receivers' ``notice_group`` (the version's header goes first, over
            it: ``receiver``'s docstring); None: over ``sync_group``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layout: ParallelLayout,
        sync_group: dist.ProcessGroup | None,
        source: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        notice_group: dist.ProcessGroup | None = None,
    ) -> None:
        if layout.pp_size > 1:
            raise ValueError("weight sync needs pipeline_model_parallel_size == 1 on the trainer")
        model = one_chunk(model)
        self.tensors: list[SyncTensor] = sync_tensors(model)
        self.source, self.sync_group = source, sync_group
        self.notice_group = sync_group if notice_group is None else notice_group
        self.is_source = dist.get_rank() == source
        self.device = self.tensors[0].params[0].device
        coords = Coords.of(model, layout)
        self.gathers = {
            kind: self._gather_of(group, coords)
            for kind, group in (("tp", layout.tp_group), ("expert", expert_group(model, layout)))
        }
        self.metas = [
            TensorMeta(t.key, t.global_shape(coords), str(t.dtype), t.vocab) for t in self.tensors
        ]
        self.buckets = plan_buckets(self.metas, bucket_bytes)
        self._buffers: list[Tensor] = []
        if self.is_source:
            dist.broadcast_object_list([self.metas, bucket_bytes], src=source, group=sync_group)
            size = max(b.nbytes for b in self.buckets)
            n = min(2, len(self.buckets))
            self._buffers = [
                torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(n)
            ]
            self._header = header_tensor(self.notice_group, self.device)

    def _gather_of(self, group: dist.ProcessGroup | None, coords: Coords) -> _Gather:
        members = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
        return _Gather(group, exchange_coords(group, coords, self.device), self.source in members)

    @property
    def nbytes(self) -> int:
        """Bytes one sync broadcasts."""
        return sum(b.nbytes for b in self.buckets)

    @torch.no_grad()
    def send(self, version: int) -> dict[str, float]:
        """Send the current weights, tagged ``version``; returns (on every trainer rank)
        ``rollout/weight_sync_seconds`` (this call's wall time, until the broadcasts
        completed) and ``rollout/weight_sync_gib`` (the bytes broadcast; 0 off the source)."""
        t0 = time.perf_counter()
        works: list = []  # the buckets' broadcasts
        if self.is_source:  # the header first: the receivers post their buckets once it came
            self._header.fill_(version)
            header = dist.broadcast(self._header, self.source, self.notice_group, async_op=True)
        full: dict[int, Tensor] = {}
        for b, bucket in enumerate(self.buckets):
            self._gather([s.index for s in bucket.segments if s.row0 == 0], full)
            if not self.is_source:
                continue
            if b >= 2:
                works[b - 2].wait()  # the broadcast that last read this buffer
            buf = self._buffers[b % 2]
            for s in bucket.segments:
                seg = as_bytes(full[s.index][s.row0 : s.row1])
                buf[s.offset : s.offset + seg.numel()].copy_(seg)
                if s.row1 == self.metas[s.index].shape[0]:
                    del full[s.index]
            works.append(self._broadcast(buf[: bucket.nbytes]))
        for w in [header, *works] if self.is_source else []:
            w.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        gib = self.nbytes / GIB if self.is_source else 0.0
        return {
            "rollout/weight_sync_seconds": time.perf_counter() - t0,
            "rollout/weight_sync_gib": gib,
        }

    def _broadcast(self, t: Tensor):
        return dist.broadcast(t, self.source, group=self.sync_group, async_op=True)

    def _gather(self, indices: list[int], full: dict[int, Tensor]) -> None:
        """The global tensors ``indices`` into ``full`` on the source (gathered over the TP and
        expert groups; the ranks of those groups take part)."""
        for kind in ("replicated", "tp", "expert"):
            ts = [i for i in indices if self.tensors[i].kind == kind]
            if not ts:
                continue
            if kind == "replicated":
                if self.is_source:
                    full.update({i: self.tensors[i].params[0].contiguous() for i in ts})
                continue
            g = self.gathers[kind]
            if g.member:
                self._gather_kind(ts, g, full)

    def _gather_kind(self, indices: list[int], g: _Gather, full: dict[int, Tensor]) -> None:
        shapes = [self.metas[i].shape for i in indices]
        got = gather_tensors(self.tensors, indices, shapes, g.group, g.coords, self.is_source)
        full.update(got)


def gather_tensors(
    tensors: list[SyncTensor],
    indices: list[int],
    shapes: list[tuple[int, ...]],
    group: dist.ProcessGroup | None,
    coords: list[Coords],
    assemble: bool = True,
) -> dict[int, Tensor]:
    """The global tensors ``tensors[i]`` (``i`` in ``indices``; global ``shapes``) from the
    shards of ``group``'s ranks (at ``coords``, in group-rank order): one ``all_gather`` of
    their bytes. Every rank of ``group`` calls it; those with ``assemble`` get the tensors
    (the others an empty dict)."""
    offsets, n = [], 0
    for i in indices:
        offsets.append(n)
        t = tensors[i]
        n = _aligned(n + math.prod(t.local_shape) * t.dtype.itemsize)
    device = tensors[indices[0]].params[0].device
    flat = torch.empty(n, dtype=torch.uint8, device=device)
    for i, off in zip(indices, offsets, strict=True):
        t = tensors[i]
        dst = bytes_as(flat, off, t.local_shape, t.dtype)
        if t.stacked:
            for e, p in enumerate(t.params):
                dst[e].copy_(p)
        else:
            dst.copy_(t.params[0])
    if group is None:
        gathered = flat
    else:
        gathered = torch.empty(n * group.size(), dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(gathered, flat, group=group)
    if not assemble:
        return {}
    full = {}
    for i, off, shape in zip(indices, offsets, shapes, strict=True):
        t = tensors[i]
        out = torch.empty(shape, dtype=t.dtype, device=device)
        for r, c in enumerate(coords):
            local = bytes_as(gathered, r * n + off, t.local_shape, t.dtype)
            for piece in t.pieces(c):
                out[piece.glob].copy_(local[piece.local])
        full[i] = out
    return full
