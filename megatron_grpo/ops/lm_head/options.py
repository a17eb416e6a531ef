"""``LMHeadOptions``: how the LM-head op runs, one frozen value validated once.

The options that ``vocab_parallel_logprobs``, ``fused_grpo_loss``, their ``*_plan`` twins,
``plan_lm_head`` and ``GRPOStep`` share: the requested log-prob path, the kernel impl, the
GEMM mode, the memory budget, the tile / chunk rows, the temperature and the real vocabulary
size. Where the call runs (TP group, sequence parallelism) is not an option: it comes with
the call. This module also holds the one list of log-prob paths (:data:`PATHS`,
:data:`REQUESTS`): ``ops.lm_head.plan``, ``GRPOStep``, the memory plan and the training config read
it from here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields, replace
from typing import Literal, get_args

from megatron_grpo.config import RUNTIME_ONLY
from megatron_grpo.ops.kernels import check_choice
from megatron_grpo.ops.lm_head.tiling import TILE_BYTES

# The paths a plan can run ("megatron": Megatron's output layer, run by GRPOStep alone) and the
# requests a caller may make ("fused": the plan picks the fused path); the Literal types are
# what config fields are annotated with, the tuples what code checks against.
LMHeadPath = Literal["op", "fused_tiled", "fused_single_pass", "megatron"]
LMHeadRequest = Literal["fused", LMHeadPath]
PATHS: tuple[str, ...] = get_args(LMHeadPath)
REQUESTS: tuple[str, ...] = get_args(LMHeadRequest)
GEMMS = ("separate", "fused_epilogue")

TILE_FRACTION = 4  # one fp32 logits tile = memory_budget / TILE_FRACTION
DEFAULT_MEMORY_BUDGET = TILE_FRACTION * TILE_BYTES  # 1 GiB
MIN_MEMORY_BUDGET = TILE_FRACTION * 4  # a tile of one fp32 element


@dataclass(frozen=True)
class LMHeadOptions:
    """The LM-head op's options (module docstring); errors name the field.

    Attributes:
        path: the request: None / "fused" (the plan picks), or one of :data:`PATHS`
            ("op": log-probs then the loss; "megatron": ``GRPOStep`` only).
        impl: the kernel seam, "auto", "torch" or "triton" (``ops.kernels``).
        gemm: "auto" or one of :data:`GEMMS` (``ops.lm_head.plan``).
        memory_budget: bytes of the LM head's working set, trading memory for speed; None =
            :data:`DEFAULT_MEMORY_BUDGET` (1 GiB).
        chunk_size: rows per logits tile / single-pass chunk; None = automatic.
        temperature: logits are divided by it.
        vocab_size: the real vocabulary (padded rows ``>= vocab_size`` never contribute);
            None = V_local * TP.
    """

    path: str | None = None
    impl: str = "auto"
    gemm: str = "auto"
    memory_budget: int | None = None
    chunk_size: int | None = None
    # The recipe's ``lm_head`` section sets the others; these two come from the model and the
    # sampling temperature (the log-probs must be the generator's).
    temperature: float = field(default=1.0, metadata=RUNTIME_ONLY)
    vocab_size: int | None = field(default=None, metadata=RUNTIME_ONLY)

    def __post_init__(self) -> None:
        if self.path is not None and self.path not in REQUESTS:
            raise ValueError(f"path must be one of {list(REQUESTS)} or None, got {self.path!r}")
        check_choice("impl", self.impl)
        if self.gemm != "auto" and self.gemm not in GEMMS:
            raise ValueError(f"gemm must be 'auto' or one of {list(GEMMS)}, got {self.gemm!r}")
        if self.memory_budget is not None and (
            not is_int(self.memory_budget) or self.memory_budget < MIN_MEMORY_BUDGET
        ):
            raise ValueError(
                f"memory_budget must be an int >= {MIN_MEMORY_BUDGET} bytes or None, "
                f"got {self.memory_budget!r}"
            )
        if self.chunk_size is not None and (not is_int(self.chunk_size) or self.chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size!r}")
        _check_temperature(self.temperature)
        if self.vocab_size is not None and (not is_int(self.vocab_size) or self.vocab_size < 1):
            raise ValueError(f"vocab_size must be a positive int or None, got {self.vocab_size!r}")

    @property
    def budget(self) -> int:
        """The memory budget in bytes (the default resolved)."""
        return DEFAULT_MEMORY_BUDGET if self.memory_budget is None else self.memory_budget

    @staticmethod
    def of(options: LMHeadOptions | None = None, **overrides: object) -> LMHeadOptions:
        """``options`` (default: all defaults) with the keyword ``overrides`` applied: the
        keyword forms of the public functions. An unknown name raises TypeError."""
        if options is None:
            return LMHeadOptions(**overrides)
        return replace(options, **overrides) if overrides else options

    @staticmethod
    def field_names() -> frozenset[str]:
        """The option names (what the keyword forms accept)."""
        return frozenset(f.name for f in fields(LMHeadOptions))


def _check_temperature(temperature: object) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")


def is_int(x: object) -> bool:
    """An integer (numpy's too), not a bool: the one check of every integer option."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
