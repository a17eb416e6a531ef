"""Routes of the generation's MoE forwards, per sample (Rollout Routing Replay, R3).

``generate(..., record_routes=True)`` also returns, per sample, an int64 ``[P + R, L, k]``
tensor (the layout of ``RolloutBatch.routed_experts``): row ``t`` holds the top-k expert ids
that each of the L MoE layers' routers chose for *input* token ``t`` of ``prompt + response``
in the generation forward that fed that token: the prefill for prompt tokens, the decode step
that fed response token ``t - P`` to sample the next one (the recompute engine: the step that
first fed it). Training replays row ``t`` for the same input token (``megatron/batch/packing.py``:
routes belong to input tokens, not shifted), so every log-prob of a response token is computed
with the routes that produced it.

The last response token is sampled, never fed, so its row is -1: ``routing_replay`` routes
-1 rows live. Training feeds it only as the last input of its sequence, whose output predicts
nothing (``loss_mask`` False there), and attention is causal, so no log-prob depends on it.

Dropped: padding of packed inputs, the dummy rows / documents that keep an expert-parallel
group in lock step. Decode rows map to samples through the engine's ``run.rows`` of that step
(before finished rows are compacted away).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from megatron_grpo.megatron.moe.routing_replay import RouteRecorder, num_moe_layers, record_routes


class RouteLog:
    """Collects the routes of one generate call, forward by forward.

    Storage: one CPU buffer of ``sum(P_i + max_new_tokens)`` rows (int16 when the expert ids
    fit), -1 until written; :meth:`result` cuts each sample's ``P + R`` rows as int64."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], max_new: int) -> None:
        cfg = model.config
        if cfg.num_moe_experts is None:
            raise ValueError("record_routes needs an MoE model (num_moe_experts is None)")
        self.model = model
        self.prompt_lens = [len(p) for p in prompts]
        spans = torch.tensor([n + max_new for n in self.prompt_lens])
        self.offsets = torch.cumsum(spans, 0) - spans
        dtype = torch.int16 if cfg.num_moe_experts < 2**15 else torch.int32
        shape = (int(spans.sum()), num_moe_layers(cfg), cfg.moe_router_topk)
        self.buf = torch.full(shape, -1, dtype=dtype)
        self._rec: RouteRecorder | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """The model's routers record while the block runs (hooks left in place, idle)."""
        with record_routes(self.model) as rec:
            self._rec = rec
            try:
                yield
            finally:
                self._rec = None

    def packed(self, samples: list[int], cu_seqlens: Tensor, starts: list[int] | None = None):
        """After a packed forward whose document ``j`` holds tokens ``0 .. n_j - 1`` of sample
        ``samples[j]``: keep rows of positions ``starts[j] ..`` (default 0). Documents beyond
        ``samples`` (a dummy one) and the padding after the last are dropped."""
        routes = self._take()
        if not samples:
            return
        cu = cu_seqlens.tolist()
        src, dst = [], []
        for j, i in enumerate(samples):
            start = starts[j] if starts is not None else 0
            src.append(torch.arange(cu[j] + start, cu[j + 1]))
            dst.append(torch.arange(start, cu[j + 1] - cu[j]) + self.offsets[i])
        self._store(routes, torch.cat(src), torch.cat(dst))

    def rows(self, samples: list[int], positions: list[int]) -> None:
        """After a decode step: row ``r`` fed sample ``samples[r]``'s token at ``positions[r]``;
        the rows after them (dummy rows of an expert-parallel group) are dropped."""
        routes = self._take()
        if not samples:
            return
        dst = self.offsets[samples] + torch.tensor(positions)
        self._store(routes, torch.arange(len(samples)), dst)

    def result(self, responses: list[list[int]]) -> list[Tensor]:
        """Per sample int64 ``[P + R, L, k]``; every row but the last holds expert ids."""
        out = []
        for i, resp in enumerate(responses):
            start = int(self.offsets[i])
            r = self.buf[start : start + self.prompt_lens[i] + len(resp)].long()
            if bool((r[:-1] < 0).any()):  # a fed token whose forward was not recorded
                raise RuntimeError(f"routes of sample {i} are incomplete (an engine bug)")
            out.append(r)
        return out

    def restore(self, i: int, routes: Tensor) -> None:
        """Sample ``i``'s routes carried from an earlier call (rows ``0 ..``)."""
        start = int(self.offsets[i])
        self.buf[start : start + len(routes)] = routes.to(self.buf.dtype)

    def sample_rows(self, i: int, n: int) -> Tensor:
        """Sample ``i``'s first ``n`` rows, int64 (-1 where no forward fed them yet)."""
        start = int(self.offsets[i])
        return self.buf[start : start + n].long()

    def _take(self) -> Tensor:
        if self._rec is None:
            raise RuntimeError("RouteLog: a forward ran outside RouteLog.recording()")
        return self._rec.take()

    def _store(self, routes: Tensor, src: Tensor, dst: Tensor) -> None:
        self.buf[dst] = routes[src.to(routes.device)].cpu().to(self.buf.dtype)


def recording(log: RouteLog | None) -> contextlib.AbstractContextManager:
    """``log.recording()``, or nothing when routes are not recorded."""
    return log.recording() if log is not None else contextlib.nullcontext()
