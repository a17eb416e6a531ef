"""The toy task of the tiny recipe: reverse k digits. Built-in character tokenizer.

Prompt ``<bos> d1 d2 .. dk =``, target ``dk .. d1 <eos>``. The reward is the fraction of the
k + 1 target tokens the response matches position by position, so a random policy over the 13
real tokens scores (1 - (12/13)^(k+1)) / (k + 1) (0.068 for k = 3: a guessed ``<eos>`` ends the
response) while partial progress (one digit right) is rewarded. A transformer
solves it by attending back a fixed, position-dependent distance, which a ~1M-parameter model
learns from rewards alone in a few dozen steps.
"""

from __future__ import annotations

import math
import random

from megatron_grpo.rollout.tasks.base import Prompt

_DIGITS = "0123456789"


class DigitTokenizer:
    """Ids 0-9 are the digits, then ``=``, ``<bos>``, ``<eos>`` (vocab_size 13)."""

    EQUALS, BOS, EOS = 10, 11, 12
    _SPECIAL = {"=": 10, "<bos>": 11, "<eos>": 12}

    @property
    def vocab_size(self) -> int:
        return 13

    @property
    def eos_id(self) -> int:
        return self.EOS

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for name, tid in self._SPECIAL.items():
                if text.startswith(name, i):
                    ids.append(tid)
                    i += len(name)
                    break
            else:
                if text[i] not in _DIGITS:
                    raise ValueError(f"DigitTokenizer cannot encode {text[i]!r} in {text!r}")
                ids.append(int(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self._SPECIAL.items()}
        out = []
        for tid in ids:
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"token id {tid} is outside the DigitTokenizer vocab (13)")
            out.append(_DIGITS[tid] if tid < 10 else names[tid])
        return "".join(out)


class ReverseDigitsTask:
    """Prompt ``i`` is drawn from ``random.Random(f"{seed}/{i}")``: reproducible by index.

    ``num_digits``: k, or ``[lo, hi]``: k drawn per prompt log-uniformly in ``[lo, hi]`` (long
    tails: most prompts short, a few long), each response limited to its answer's k + 1 tokens
    (``Prompt.max_new_tokens``) so that response lengths follow k."""

    def __init__(self, num_digits: int | list[int], seed: int) -> None:
        lo, hi = num_digits if isinstance(num_digits, (list, tuple)) else (num_digits, num_digits)
        if not 0 < lo <= hi:
            raise ValueError(f"num_digits must be positive (lo <= hi), got {num_digits}")
        self.num_digits = num_digits
        self.ranged = isinstance(num_digits, (list, tuple))
        self.lo, self.hi = lo, hi
        self.seed = seed
        self.tokenizer = DigitTokenizer()

    def prompts(self, start: int, n: int) -> list[Prompt]:
        out = []
        for i in range(start, start + n):
            rng = random.Random(f"{self.seed}/{i}")
            k = self._length(rng) if self.ranged else self.lo
            digits = "".join(rng.choice(_DIGITS) for _ in range(k))
            text = f"<bos>{digits}="
            limit = k + 1 if self.ranged else None
            out.append(
                Prompt(tuple(self.tokenizer.encode(text)), text, digits[::-1], max_new_tokens=limit)
            )
        return out

    def _length(self, rng: random.Random) -> int:
        """Log-uniform on ``[lo, hi]``: ``floor(exp(U[log lo, log(hi + 1))))``."""
        k = int(math.exp(rng.uniform(math.log(self.lo), math.log(self.hi + 1))))
        return min(max(k, self.lo), self.hi)

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        target = self.tokenizer.encode(prompt.answer) + [self.tokenizer.eos_id]
        hits = sum(
            int(a == b) for a, b in zip(response_ids, target, strict=False)
        )  # may be shorter
        return hits / len(target)
