"""``RolloutBatch``: one step's samples as ragged per-sample lists (the unit of file I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RolloutBatch:
    """B samples; sample ``i`` is ``prompt_ids[i] + response_ids[i]``.

    Attributes:
        prompt_ids / response_ids: token ids per sample (responses non-empty).
        rollout_logprobs: per response token, the log-prob the generator saw (``None`` when the
            source did not record them; IS correction then cannot be used).
        rewards: one float per sample (``None`` before scoring).
        group_ids: samples of the same prompt share an id (one advantage group).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    group_ids: list[int]
    rollout_logprobs: list[list[float]] | None = None
    rewards: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        for name in ("response_ids", "group_ids", "rollout_logprobs", "rewards"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries, prompt_ids has {n}")
        for i, (p, r) in enumerate(zip(self.prompt_ids, self.response_ids, strict=True)):
            if not p or not r:
                raise ValueError(f"sample {i}: prompt_ids and response_ids must be non-empty")
        if self.rollout_logprobs is not None:
            for i, (r, lp) in enumerate(zip(self.response_ids, self.rollout_logprobs, strict=True)):
                if len(lp) != len(r):
                    raise ValueError(
                        f"sample {i}: rollout_logprobs has {len(lp)} values for {len(r)} "
                        "response tokens"
                    )
        if self.rewards is not None:
            bad = [i for i, r in enumerate(self.rewards) if not math.isfinite(r)]
            if bad:
                raise ValueError(f"rewards are non-finite at samples {bad[:8]}")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True))

    def select(self, idx: list[int]) -> RolloutBatch:
        """The samples at ``idx`` (in that order)."""

        def pick(xs):
            return None if xs is None else [xs[i] for i in idx]

        return RolloutBatch(
            prompt_ids=pick(self.prompt_ids),
            response_ids=pick(self.response_ids),
            group_ids=pick(self.group_ids),
            rollout_logprobs=pick(self.rollout_logprobs),
            rewards=pick(self.rewards),
        )

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        def cat(name: str):
            parts = [getattr(b, name) for b in batches]
            if any(p is None for p in parts):
                return None
            return [x for p in parts for x in p]

        return RolloutBatch(
            prompt_ids=cat("prompt_ids"),
            response_ids=cat("response_ids"),
            group_ids=cat("group_ids"),
            rollout_logprobs=cat("rollout_logprobs"),
            rewards=cat("rewards"),
        )
