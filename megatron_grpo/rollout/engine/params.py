"""Sampling parameters of a generation call (also a recipe's ``rollout.sampling`` section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_grpo.config import RUNTIME_ONLY


@dataclass(frozen=True)
class SamplingParams:
    """How each response token is drawn.

    A recipe's ``rollout.sampling`` section sets ``temperature``, ``top_p``, ``top_k``,
    ``stop_ids`` and ``ignore_eos``; the trainer fills in ``max_new_tokens``
    (``rollout.max_response_length``), ``eos_id`` (the task's tokenizer) and ``vocab_size``
    (``model.vocab_size``). Generation needs all three (:meth:`check_complete`).

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

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = field(default=None, metadata=RUNTIME_ONLY)
    eos_id: int | None = field(default=None, metadata=RUNTIME_ONLY)
    vocab_size: int | None = field(default=None, metadata=RUNTIME_ONLY)
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off, 1 = greedy), got {self.top_k}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
        bad = [i for i in self.stop_ids if i < 0]
        if bad:
            raise ValueError(f"stop_ids must be token ids >= 0, got {bad[0]}")
        if self.vocab_size is None:
            return
        ids = [("eos_id", self.eos_id)] if self.eos_id is not None else []
        for name, tid in ids + [("stop_ids", i) for i in self.stop_ids]:
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"{name} {tid} is outside the vocabulary [0, {self.vocab_size})")

    def check_complete(self) -> None:
        """Generation needs ``max_new_tokens``, ``eos_id`` and ``vocab_size``."""
        missing = [
            n for n in ("max_new_tokens", "eos_id", "vocab_size") if getattr(self, n) is None
        ]
        if missing:
            raise ValueError(
                f"SamplingParams needs {', '.join(missing)} to generate (a recipe's "
                "rollout.sampling gets them from rollout.max_response_length, the task and "
                "the model)"
            )

    @property
    def stops(self) -> frozenset[int]:
        """The ids that end a response (empty when ``ignore_eos``)."""
        return frozenset() if self.ignore_eos else frozenset((self.eos_id, *self.stop_ids))
