"""``RolloutBatch``: one step's samples as ragged per-sample lists (the unit of file I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class RolloutBatch:
    """B samples; sample ``i`` is ``prompt_ids[i] + response_ids[i]``.

    Attributes:
        prompt_ids / response_ids: token ids per sample (responses non-empty).
        rollout_logprobs: per response token, the log-prob the generator saw (``None`` when the
            source did not record them; IS correction then cannot be used).
        rewards: one float per sample (``None`` before scoring).
        group_ids: samples of the same prompt share an id (one advantage group).
        routed_experts: MoE routing replay: per sample an int tensor ``[P + R, L, k]``, the top-k
            expert ids the generator's router chose for each prompt and response token (as
            input) in each of the L MoE layers; rows of -1 have no recorded route (replayed
            with live routing). ``None`` when not recorded.
        origins: where each sample came from (``"file:line"``), for error messages.
        reward_extras: per-sample numbers that came with the rewards, by name (one list per
            name, NaN where a sample has none): a dict reward's keys besides ``score`` and
            ``timeouts`` (1.0 where the reward call timed out), logged as ``reward/<name>``.
            ``None`` when there are none.
        policy_versions: per response token, the policy version (training step) whose weights
            sampled it (partial rollouts, ``rollout/partial.py``); ``None``: all of this step's.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    group_ids: list[int]
    rollout_logprobs: list[list[float]] | None = None
    rewards: list[float] | None = None
    # Not in ==: tensors have no single truth value; origins are provenance, not data.
    routed_experts: list[Tensor] | None = field(default=None, compare=False)
    origins: list[str] | None = field(default=None, compare=False)
    reward_extras: dict[str, list[float]] | None = field(default=None, compare=False)
    policy_versions: list[list[int]] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        for name in ("response_ids", "group_ids", "rollout_logprobs", "rewards", *_EXTRA):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries, prompt_ids has {n}")
        for name, value in (self.reward_extras or {}).items():
            if len(value) != n:
                raise ValueError(
                    f"reward_extras[{name!r}] has {len(value)} entries, prompt_ids has {n}"
                )
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
        for i, (r, v) in enumerate(
            zip(self.response_ids, self.policy_versions or [], strict=False)
        ):
            if len(v) != len(r):
                raise ValueError(f"sample {i}: {len(v)} policy_versions for {len(r)} tokens")
        if self.rewards is not None:
            bad = [i for i, r in enumerate(self.rewards) if not math.isfinite(r)]
            if bad:
                raise ValueError(f"rewards are non-finite at samples {bad[:8]}")
        for i, r in enumerate(self.routed_experts or []):
            n_tok = len(self.prompt_ids[i]) + len(self.response_ids[i])
            if r.dim() != 3 or r.shape[0] != n_tok:
                raise ValueError(
                    f"{self.origin(i)}: routed_experts must be [{n_tok} tokens, L, k], got "
                    f"{list(r.shape)}"
                )

    def origin(self, i: int) -> str:
        return self.origins[i] if self.origins is not None else f"sample {i}"

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True))

    def select(self, idx: list[int]) -> RolloutBatch:
        """The samples at ``idx`` (in that order)."""

        def pick(xs):
            return None if xs is None else [xs[i] for i in idx]

        extras = self.reward_extras
        return RolloutBatch(
            prompt_ids=pick(self.prompt_ids),
            response_ids=pick(self.response_ids),
            group_ids=pick(self.group_ids),
            rollout_logprobs=pick(self.rollout_logprobs),
            rewards=pick(self.rewards),
            routed_experts=pick(self.routed_experts),
            origins=pick(self.origins),
            reward_extras=None if extras is None else {k: pick(v) for k, v in extras.items()},
            policy_versions=pick(self.policy_versions),
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
            routed_experts=cat("routed_experts"),
            origins=cat("origins"),
            reward_extras=_concat_extras(batches),
            policy_versions=cat("policy_versions"),
        )


def _concat_extras(batches: list[RolloutBatch]) -> dict[str, list[float]] | None:
    """The batches' ``reward_extras`` one after the other; NaN where a batch lacks a name."""
    if all(b.reward_extras is None for b in batches):
        return None
    names = list(dict.fromkeys(k for b in batches for k in (b.reward_extras or {})))
    return {
        k: [x for b in batches for x in (b.reward_extras or {}).get(k, [math.nan] * len(b))]
        for k in names
    }


_EXTRA = ("routed_experts", "origins", "policy_versions")
