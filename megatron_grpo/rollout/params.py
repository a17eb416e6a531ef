"""Sampling parameters of a generation call."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How each response token is drawn.

    Attributes:
        temperature: logits are divided by it; the recorded log-prob is that of the sampled token
            under ``log_softmax(logits / temperature)`` over the real vocabulary, before top-k /
            top-p truncation (the distribution the training passes score).
        top_p: nucleus sampling (1.0 = off): the smallest prefix of the sorted distribution whose
            mass reaches ``top_p`` is kept (the most likely token always is).
        max_new_tokens: response length limit, the stop token included.
        eos_id: ends a response (kept as its last token), unless ``ignore_eos``.
        vocab_size: the real vocabulary; padded ids ``>= vocab_size`` are never sampled.
        top_k: keep the ``top_k`` most likely tokens (0 = off; 1 = greedy).
        stop_ids: further token ids that end a response, like ``eos_id``.
        ignore_eos: never stop before ``max_new_tokens`` (benchmarks, fixed-length tasks).
    """

    temperature: float
    top_p: float
    max_new_tokens: int
    eos_id: int
    vocab_size: int
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off, 1 = greedy), got {self.top_k}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
        for name, tid in [("eos_id", self.eos_id)] + [("stop_ids", i) for i in self.stop_ids]:
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"{name} {tid} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def stops(self) -> frozenset[int]:
        """The ids that end a response (empty when ``ignore_eos``)."""
        return frozenset() if self.ignore_eos else frozenset((self.eos_id, *self.stop_ids))
