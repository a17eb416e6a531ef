"""The host-side state of one ``KVCacheEngine.generate`` call and of a decode step in flight,
and what a ``generate`` call returns (:class:`Generation`).

Every sample's tokens and log-probs live in ``[N, max_new_tokens]`` tables that a decode step
updates with a few vectorized ops (no per-row Python per token), so the host keeps up with a
GPU step of a few milliseconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from megatron_grpo.rollout.engine.params import SamplingParams
from megatron_grpo.rollout.engine.routes import RouteLog


@dataclass(frozen=True)
class Generation:
    """The result of ``generate``: per sample its response ids (ending in a stop id unless cut at
    ``max_new_tokens``), the recorded log-prob of each response token and, when routes were
    recorded (MoE routing replay), its routes int64 ``[P + R, L, k]`` (else None)."""

    responses: list[list[int]]
    logprobs: list[list[float]]
    routes: list[torch.Tensor] | None = None

    @classmethod
    def of(
        cls, responses: list[list[int]], logprobs: list[list[float]], log: RouteLog | None
    ) -> Generation:
        return cls(responses, logprobs, None if log is None else log.result(responses))


@dataclass
class Run:
    """The state of one generate call: active rows are slots ``0 .. len(rows) - 1``. Every
    sample's tokens and log-probs so far live in host tables, updated a whole step at a time
    (no per-row Python work per token)."""

    prompts: list[list[int]]
    params: SamplingParams
    uniforms: torch.Tensor  # [N, max_new_tokens] on the device
    waiting: deque[int]
    rows: list[int]  # sample index of each active row
    tokens: torch.Tensor  # [N, max_new_tokens] int64
    logps: torch.Tensor  # [N, max_new_tokens] float64
    lengths: torch.Tensor  # [N] response tokens so far
    prompt_lens: torch.Tensor  # [N]
    stops: torch.Tensor  # ids that end a response
    limits: torch.Tensor  # [N] response tokens each sample may have (<= max_new_tokens)
    finished: torch.Tensor  # [N] bool
    routes: RouteLog | None = None  # MoE routing replay: routes of every forward

    @classmethod
    def start(
        cls,
        prompts: list[list[int]],
        params: SamplingParams,
        uniforms: torch.Tensor,
        limits: list[int | None] | None = None,
    ):
        """``limits``: per sample its own response limit (None: ``max_new_tokens``)."""
        n, m = len(prompts), params.max_new_tokens
        caps = [m if k is None else min(k, m) for k in (limits or [None] * n)]
        return cls(
            [list(map(int, p)) for p in prompts],
            params,
            uniforms,
            deque(range(n)),
            [],
            torch.zeros(n, m, dtype=torch.long),
            torch.zeros(n, m, dtype=torch.float64),
            torch.zeros(n, dtype=torch.long),
            torch.tensor([len(p) for p in prompts]),
            torch.tensor(sorted(params.stops), dtype=torch.long),
            torch.tensor(caps, dtype=torch.long),
            torch.zeros(n, dtype=torch.bool),
        )

    def record(self, samples: torch.Tensor, tokens: torch.Tensor, logps: torch.Tensor):
        """Append one token to each of ``samples``; returns which of them are now done."""
        at = self.lengths[samples]
        self.tokens[samples, at] = tokens
        self.logps[samples, at] = logps.double()
        self.lengths[samples] = at + 1
        done = (at + 1 >= self.limits[samples]) | torch.isin(tokens, self.stops)
        self.finished[samples[done]] = True
        return done

    def prefix(self, i: int) -> list[int]:
        """What sample ``i``'s cache holds before its next decode step: the prompt and every
        response token but the last (which the next step feeds)."""
        fed = max(int(self.lengths[i]) - 1, 0)
        return self.prompts[i] + self.tokens[i, :fed].tolist()

    def prefix_len(self, i: int) -> int:
        return int(self.prompt_lens[i]) + max(int(self.lengths[i]) - 1, 0)

    def longest(self, new: list[int]) -> int:
        """The longest sequence (prompt + response) of the next decode step's rows: the active
        ones and ``new`` once prefilled (their first token sampled, or a resumed one's last
        fed)."""
        rows = torch.tensor(self.rows, dtype=torch.long)
        active = int((self.prompt_lens[rows] + self.lengths[rows]).max()) if self.rows else 1
        return max([active, *(self.prefix_len(i) + 1 for i in new)])

    def steps_left(self, new: list[int]) -> int:
        """Decode steps until the first of the next step's rows (the active ones and ``new``
        once prefilled) reaches its limit, at least 1 (a row may stop sooner on a stop id)."""
        rows = torch.tensor(self.rows + new, dtype=torch.long)
        if not len(rows):
            return 1
        return max(int((self.limits[rows] - self.lengths[rows].clamp(min=1)).min()), 1)

    def feeds(self, samples: torch.Tensor) -> torch.Tensor:
        """``[4, k]``: token, position, sample and response length each row feeds next."""
        lens = self.lengths[samples]
        last = self.tokens[samples, lens - 1]
        return torch.stack((last, self.prompt_lens[samples] + lens - 1, samples, lens))

    def results(self) -> tuple[list[list[int]], list[list[float]]]:
        lens = self.lengths.tolist()
        return (
            [t[:k] for t, k in zip(self.tokens.tolist(), lens, strict=True)],
            [lp[:k] for lp, k in zip(self.logps.tolist(), lens, strict=True)],
        )

    def retire(self, finished: list[int]) -> tuple[list[int], list[int]]:
        """Drop the ``finished`` rows (ascending), moving the last active rows into their
        slots; returns the cache rows to copy (``src`` -> ``dst``). Each destination is copied
        from its row's origin, so a row moved twice (into a finished slot that is later the
        last one and moves on) comes from where its cache is; origins lie past the new row
        count, so no copy reads a slot another one wrote."""
        origin: dict[int, int] = {}  # destination slot -> the slot holding its row's cache now
        for r in reversed(finished):  # highest first: a moved row is never finished
            last = len(self.rows) - 1
            if r != last:
                origin[r] = origin.pop(last, last)
                self.rows[r] = self.rows[last]
            self.rows.pop()
        dst = list(origin)
        return [origin[d] for d in dst], dst


@dataclass(frozen=True)
class Launched:
    """A decode step in flight: its rows' samples, the host copy of its ``[2, n]`` tokens and
    log-probs (valid once ``event`` completed; None: already synchronous), its context."""

    samples: torch.Tensor
    out: torch.Tensor
    event: torch.cuda.Event | None
    ctx: int
