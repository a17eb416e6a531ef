"""Requests that outlive one generation call: paused at a step boundary, resumed later.

``KVCacheEngine.run_requests(requests, params, version, stop=...)`` generates until every
request finished or ``stop`` says so, then writes each request's new tokens back, tagged with
the policy ``version`` that sampled them. A paused request resumes in a later call (under
updated weights) from what it holds:

* ``kv is None`` (``recompute``): its prompt and tokens but the last are prefilled again under
  the current weights, then decoding continues by feeding the last token. Every token's
  log-prob is then the log-prob of the version that sampled it, given its prefix.
* ``kv`` set (``keep``): the cached keys / values of those positions (computed by the weights
  that fed them) are copied back into a slot: no prefill.

Sampling reads ``uniforms[t]`` for response position ``t`` whenever it runs, so a request
draws the same numbers however often it is paused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_grpo.rollout.engine.params import SamplingParams
from megatron_grpo.rollout.engine.run_state import Run


@dataclass
class Request:
    """One sample in flight: prompt, its uniforms ``[max_new_tokens]`` (CPU, float32), the
    response so far with each token's behaviour log-prob and policy version, its own response
    limit (None: ``max_new_tokens``), whether it finished, and what a resume needs: ``kv``
    (``keep``: ``[L, 2, n_kv, P + R - 1, d]`` on the host) and ``routes`` (MoE routing replay:
    the routes of the fed positions ``[P + R - 1, L, k]``)."""

    prompt: list[int]
    uniforms: torch.Tensor
    limit: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    kv: torch.Tensor | None = None
    routes: torch.Tensor | None = None

    @property
    def fed(self) -> int:
        """Positions whose keys / values a resume restores (every token but the last)."""
        return len(self.prompt) + max(len(self.tokens) - 1, 0)

    def state(self) -> dict:
        """Plain data for a checkpoint (tensors kept as tensors)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_state(cls, state: dict) -> Request:
        return cls(**state)


def start_run(requests: list[Request], params: SamplingParams, device: torch.device) -> Run:
    """A :class:`Run` over ``requests`` (none finished) with their responses so far."""
    if any(r.finished for r in requests):
        raise ValueError("run_requests: a finished request cannot be resumed")
    uniforms = torch.stack([r.uniforms for r in requests]).to(device)
    run = Run.start([r.prompt for r in requests], params, uniforms, [r.limit for r in requests])
    for i, r in enumerate(requests):
        k = len(r.tokens)
        if k:
            run.tokens[i, :k] = torch.tensor(r.tokens)
            run.logps[i, :k] = torch.tensor(r.logprobs, dtype=torch.float64)
            run.lengths[i] = k
    return run


def write_back(run: Run, requests: list[Request], version: int) -> None:
    """Append each request's new tokens (tagged ``version``) and mark the finished ones."""
    lens = run.lengths.tolist()
    for i, r in enumerate(requests):
        old, new = len(r.tokens), lens[i]
        if new > old:
            r.tokens += run.tokens[i, old:new].tolist()
            r.logprobs += run.logps[i, old:new].tolist()
            r.versions += [version] * (new - old)
            r.kv = None  # stale: the slot's rows are saved again below when it pauses
        r.finished = bool(run.finished[i])


def restore_kv(run: Run, requests: list[Request], kv: torch.Tensor) -> int:
    """Move requests paused with their cached rows (``keep``) straight into slots of ``kv``
    (the cache buffer ``[L, 2, slots + 1, kv_heads, seq, head_dim]``; the last slot is scratch).
    When it holds fewer sequences than were kept (less free memory after an update), the oldest
    kept requests fill it and the rest drop their rows, to be prefilled again as ``recompute``
    does (exact under the current weights). Returns how many were dropped
    (``stats["kv_recomputed"]``, ``rollout/partial_kv_recomputed``)."""
    slots = kv.shape[2] - 1
    restored = [i for i in run.waiting if requests[i].kv is not None]
    for i in restored[slots:]:
        requests[i].kv = None
    for i in restored[:slots]:
        row, slot = requests[i].kv, len(run.rows)
        want = (*kv.shape[:2], kv.shape[3], requests[i].fed, kv.shape[5])
        if tuple(row.shape) != want:
            raise ValueError(f"a kept KV row has shape {list(row.shape)}, expected {list(want)}")
        kv[:, :, slot, :, : row.shape[3]].copy_(row.to(kv.device))
        run.waiting.remove(i)
        run.rows.append(i)
    return max(len(restored) - slots, 0)
