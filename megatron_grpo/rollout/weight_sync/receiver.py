"""The generator's side: receive the buckets into a staging copy, swap it in at a step boundary.

A :class:`WeightReceiver` holds a staging copy of the rank's parameters (the double buffer) and
two bucket buffers. :meth:`~WeightReceiver.begin` starts receiving the next version: it posts the
receive of the version's header (on ``notice_group``). Once the header arrived (the sender has
begun: :meth:`~WeightReceiver.arrived`), :meth:`~WeightReceiver.post` posts the buckets:

* on GPU every bucket's broadcast and its copies into the staging tensors are queued at once on
  a side stream (two bucket buffers in turn; the stream orders their reuse), so the host returns
  at once and decode steps keep running on the current weights;
* on CPU (gloo) two buckets are in flight and :meth:`~WeightReceiver.poll` moves on.

Why the header first, on a gloo ``notice_group``: a bucket broadcast posted before the sender
has begun waits on the GPU, and anything that synchronizes the device meanwhile (freeing memory
to the driver, as the engine does at each call) waits with it; if the sender in turn waits for
this rank's rollouts, neither moves. Posted after the header, a broadcast waits at most for the
other receivers to post theirs. Without a ``notice_group`` the header shares ``sync_group``
(over NCCL it then waits on the GPU too: a caller that synchronizes its device while receiving
passes one).

:meth:`~WeightReceiver.poll` posts the buckets when the header arrived and says (without
blocking) whether the version is complete;
:meth:`~WeightReceiver.swap` waits for it and copies the staging tensors into the parameters in
one multi-tensor copy: the engine's parameters keep their storage, so its fused decoder and
CUDA graphs stay valid, and requests continue under the new weights from the next step (their
tokens tagged with the version :meth:`swap` returns). Vocabulary padding rows the trainer does
not have (its TP pads less) are zero.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.rollout.weight_sync.plan import (
    Bucket,
    Segment,
    TensorMeta,
    check_metas,
    plan_buckets,
)
from megatron_grpo.rollout.weight_sync.sender import GIB, bytes_as, header_tensor
from megatron_grpo.rollout.weight_sync.shards import Coords, SyncTensor, one_chunk, sync_tensors

Copies = tuple[list[Tensor], list[Tensor]]  # (destinations, sources) of one bucket


class WeightReceiver:
    """``WeightReceiver(model, layout, sync_group, source)`` on every generator rank (with
    the trainer's :class:`WeightSender` s: a collective); then per update ``begin()``,
    ``poll()`` between engine steps, ``swap()`` at a step boundary.

    Args:
        model: this generator rank's model (its TP / EP may differ from the trainer's).
        layout: this rank's :class:`ParallelLayout` within its replica.
        sync_group: the group of ``source`` and every generator rank.
        source: the trainer rank that sends.
        notice_group: a gloo group of the same ranks for the version's header (module
            docstring); None: the header goes over ``sync_group``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layout: ParallelLayout,
        sync_group: dist.ProcessGroup,
        source: int,
        notice_group: dist.ProcessGroup | None = None,
    ) -> None:
        if layout.pp_size > 1:
            raise ValueError("weight sync needs pipeline_model_parallel_size == 1 on generators")
        self.source, self.sync_group = source, sync_group
        self.notice_group = sync_group if notice_group is None else notice_group
        model = one_chunk(model)
        own = {t.key: t for t in sync_tensors(model)}
        coords = Coords.of(model, layout)
        self.metas, self.buckets = _sender_plan(own, coords, sync_group, source)
        tensors = [own[m.key] for m in self.metas]
        self.device = tensors[0].params[0].device
        self.staging = [
            torch.zeros(t.local_shape, dtype=t.dtype, device=self.device) for t in tensors
        ]
        self._live, self._staged = _swap_lists(tensors, self.staging)
        size = max(b.nbytes for b in self.buckets)
        self._buffers = [
            torch.empty(size, dtype=torch.uint8, device=self.device)
            for _ in range(min(2, len(self.buckets)))
        ]
        self._copies = [
            self._bucket_copies(b, bucket.segments, tensors, coords)
            for b, bucket in enumerate(self.buckets)
        ]
        self._header = header_tensor(self.notice_group, self.device)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._state = "idle"  # idle -> receiving -> (swap) idle
        self.version: int | None = None

    def _bucket_copies(
        self, b: int, segments: tuple[Segment, ...], tensors: list[SyncTensor], coords: Coords
    ) -> Copies:
        """(staging views, bucket views) that take bucket ``b`` apart into the staging tensors:
        each local piece's rows that lie in a segment."""
        buf = self._buffers[b % 2]
        dsts, srcs = [], []
        for s in segments:
            m, t = self.metas[s.index], tensors[s.index]
            seg = bytes_as(buf, s.offset, (s.row1 - s.row0, *m.shape[1:]), m.torch_dtype)
            for piece in t.pieces(coords):
                g, loc = piece.glob[0], piece.local[0]
                lo, hi = max(g.start, s.row0), min(g.stop, s.row1)
                if lo >= hi:
                    continue
                l0 = loc.start + lo - g.start
                dsts.append(self.staging[s.index][(slice(l0, l0 + hi - lo), *piece.local[1:])])
                srcs.append(seg[(slice(lo - s.row0, hi - s.row0), *piece.glob[1:])])
        return dsts, srcs

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def begin(self) -> None:
        """Start receiving the next version (the sender's :meth:`send` must follow or be under
        way); the parameters are untouched until :meth:`swap`."""
        if self._state != "idle":
            raise RuntimeError("WeightReceiver.begin: the previous version was not swapped in")
        self._state, self._posted = "receiving", False
        self._next, self._inflight, self._done_at = 0, deque(), None
        self._header_work = dist.broadcast(
            self._header, self.source, group=self.notice_group, async_op=True
        )

    def arrived(self) -> bool:
        """Whether the header of the version being received came (the sender has begun: the
        buckets can be posted); never blocks."""
        return self._state == "receiving" and self._header_work.is_completed()

    @property
    def posted(self) -> bool:
        """Whether the buckets of the version being received are posted."""
        return self._state == "receiving" and self._posted

    def post(self) -> None:
        """Post the buckets' broadcasts (once per version, after the header arrived; the
        ranks of a generator's TP group post together: ``separate.generation``)."""
        if self._state != "receiving" or self._posted:
            return
        self._posted, self._t0 = True, time.perf_counter()
        if self._cuda:  # the last swap read the staging tensors on the current stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
                self._advance()
                self._done = torch.cuda.Event(enable_timing=True)
                self._done.record()
        else:
            self._advance()

    def _broadcast(self, t: Tensor):
        return dist.broadcast(t, self.source, group=self.sync_group, async_op=True)

    def _advance(self) -> None:
        """Post buckets while a buffer is free, take the oldest apart when it is ready: on GPU
        once both buffers are posted (the side stream orders the copies after its broadcast and
        the next broadcast into a buffer after its copies, so broadcast ``b + 1`` overlaps the
        copies of ``b``; all of them are queued at once), on CPU once its broadcast completed."""
        while True:
            posted_all = self._next == len(self.buckets)
            if self._inflight and (
                (len(self._inflight) == len(self._buffers) or posted_all)
                if self._cuda
                else self._inflight[0][1].is_completed()
            ):
                b, work = self._inflight.popleft()
                work.wait()  # GPU: the side stream waits; CPU: already complete
                if self._copies[b][0]:  # empty: only padding rows this rank does not have
                    torch._foreach_copy_(*self._copies[b])
            elif not posted_all and len(self._inflight) < len(self._buffers):
                buf = self._buffers[self._next % 2][: self.buckets[self._next].nbytes]
                self._inflight.append((self._next, self._broadcast(buf)))
                self._next += 1
            else:
                return

    def poll(self) -> bool:
        """Whether the version being received is complete; posts the buckets once the header
        arrived (never blocks)."""
        if self._state != "receiving":
            return False
        if not self._posted:
            if not self.arrived():
                return False
            self.post()
        if self._cuda:
            done = self._done.query()
        else:
            self._advance()
            done = self._next == len(self.buckets) and not self._inflight
        if done and self._done_at is None:
            self._done_at = time.perf_counter()
        return done

    @torch.no_grad()
    def swap(self) -> dict[str, float]:
        """Wait for the version being received, copy it into the parameters and return its
        ``version``, ``rollout/weight_sync_seconds`` (begin to complete, as this rank saw it),
        ``rollout/weight_sync_gib`` (bytes received) and ``rollout/weight_swap_seconds`` (the
        copy: how long generation stops)."""
        if self._state != "receiving":
            raise RuntimeError("WeightReceiver.swap: begin() first")
        self._header_work.wait()
        self.post()
        if self._cuda:  # complete first, so the swap's seconds are the copy's alone
            self._done.synchronize()
            torch.cuda.current_stream(self.device).wait_event(self._done)
        else:
            while not self.poll():  # not done: a broadcast is in flight
                self._inflight[0][1].wait()
        t0 = time.perf_counter()
        torch._foreach_copy_(self._live, self._staged)
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
        t1 = time.perf_counter()
        if self._cuda:
            sync = self._start.elapsed_time(self._done) / 1e3
        else:
            sync = self._done_at - self._t0
        self.version = int(self._header.item())
        self._state = "idle"
        return {
            "version": self.version,
            "rollout/weight_sync_seconds": sync,
            "rollout/weight_sync_gib": self.nbytes / GIB,
            "rollout/weight_swap_seconds": t1 - t0,
        }


def _sender_plan(
    own: dict[str, SyncTensor], coords: Coords, group: dist.ProcessGroup, source: int
) -> tuple[list[TensorMeta], list[Bucket]]:
    """The sender's tensors and buckets (from the source), checked against this rank's."""
    got: list = [None, None]
    dist.broadcast_object_list(got, src=source, group=group)
    metas, bucket_bytes = got
    mine = {k: TensorMeta(k, t.global_shape(coords), str(t.dtype), t.vocab) for k, t in own.items()}
    check_metas(metas, mine)
    return metas, plan_buckets(metas, bucket_bytes)


def _swap_lists(tensors: list[SyncTensor], staging: list[Tensor]) -> tuple[list, list]:
    """(parameters, staging views) in matching order: SequentialMLP experts one each."""
    live, staged = [], []
    for t, s in zip(tensors, staging, strict=True):
        if t.stacked:
            live += t.params
            staged += list(s.unbind(0))
        else:
            live.append(t.params[0])
            staged.append(s)
    return live, staged
