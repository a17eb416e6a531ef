"""The fused decode step in two halves: each half's TP all-reduces overlap the other's compute.

A TP engine's decode step all-reduces two row-parallel outputs a layer, and nothing else runs
while they do: in the 8B TP 4 step at 512 rows the 72 all-reduces were a third of the step's
kernel time (docs/benchmarks.md), GEMMs and attention another half. Splitting the step's rows
into two halves pipelines them on two streams (the "two-batch overlap" of SGLang and NanoFlow)::

    compute:  A0 | A1 | M0 | M1 | A0' | ...    (A: attention half, M: MLP half of a layer)
    comm:          R(A0) | R(A1) | R(M0) | ... (each half's sum runs during the other's work)

Rows are independent in decode, so the halves give the one-batch step's tokens; each half's
GEMMs read the weights again, which costs little where the GEMMs are compute-bound (hundreds
of rows) and is what the overlap must win back.

The decision (``rollout.engine.decode_overlap``), made once by :func:`plan_overlap` as data:
the fewest rows a step splits at (0: never). "halves": every step of at least 2 rows (needs
the fused path, TP > 1 and dense layers; anything else is an error naming the field); "off":
never; "auto": the row counts :data:`MEASURED_AHEAD` lists for the TP size, else never. On CPU
there is no second stream: the halves run one after the other (the same results, no overlap).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.ops.kernels import check_choice
from megatron_grpo.rollout.engine.tp_all_reduce import Tiers, TPAllReduce

FIELD = "rollout.engine.decode_overlap"
EXPLICIT_ROWS = 2  # "halves": every step that splits into two non-empty halves
# "auto": per TP size, the fewest rows from which two halves were measured ahead of one batch
# (tools/bench_rollout.py ``+halves`` modes); none measured yet, so auto keeps one batch.
MEASURED_AHEAD: dict[int, int] = {}


def plan_overlap(choice: str, tp_size: int, decode_path: str, moe: bool) -> int:
    """The fewest rows a decode step splits into halves at (0: never). ``moe``: the model has
    MoE layers (their token dispatch runs its own collectives, once per forward)."""
    check_choice("decode_overlap", choice, FIELD)
    if choice == "off":
        return 0
    why = why_not(tp_size, decode_path, moe)
    if choice == "halves":
        if why:
            raise ValueError(f"{FIELD} 'halves' cannot run here: {why} (use 'off' or 'auto')")
        return EXPLICIT_ROWS
    return 0 if why else MEASURED_AHEAD.get(tp_size, 0)


def why_not(tp_size: int, decode_path: str, moe: bool) -> str:
    """Why an engine of ``tp_size`` on ``decode_path`` ("auto" / "fused" / "modules") cannot
    decode in halves ("" when it can): also the config's check (``TrainConfig``)."""
    if decode_path == "modules":
        return "this engine decodes through the modules"
    if tp_size == 1:
        return "TP is 1 (no all-reduce to overlap)"
    if moe:
        return "the model has MoE layers (their dispatch would run once per half)"
    return ""


def describe(rows: int) -> str:
    """The engine's start-up line's part: ``"two halves from 2 rows"`` or ``""``."""
    return f", two halves from {rows} rows (TP all-reduces overlapped)" if rows else ""


class HalvesReduce:
    """The fused step's TP sums, one half at a time: ``launch(j, t)`` starts half ``j``'s sum
    of ``t [b_j, H]`` (on the side stream where there is one), ``wait(j)`` returns it once the
    current stream may read it.

    ``reducers``: one :class:`TPAllReduce` per half (each maps its own symmetric buffer, so a
    half's sum never writes a buffer a peer may still read for the other half's); one reducer
    and ``rows`` 0: the one-batch step, every sum at once on the current stream.
    """

    def __init__(self, reducers: tuple[TPAllReduce, ...], rows: int, device: torch.device):
        if rows and len(reducers) != 2:
            raise ValueError(f"two halves need two reducers, got {len(reducers)}")
        self.reducers, self.rows = reducers, rows
        use_stream = rows and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if use_stream else None
        self._pending: list[tuple[Tensor, Tensor, torch.cuda.Event | None] | None] = [None] * 2

    @classmethod
    def build(
        cls, group: dist.ProcessGroup | None, tiers: Tiers, rows: int, device: torch.device
    ) -> HalvesReduce:
        """The reducer(s) of a TP group: two with ``rows`` (a collective of the TP group)."""
        count = 2 if rows else 1
        return cls(tuple(TPAllReduce(group, tiers, device) for _ in range(count)), rows, device)

    def halves(self, b: int) -> list[slice]:
        """The row ranges of a ``b``-row step: two halves (the first one larger) or one."""
        if not self.rows or b < self.rows:
            return [slice(0, b)]
        mid = (b + 1) // 2
        return [slice(0, mid), slice(mid, b)]

    def launch(self, j: int, t: Tensor) -> None:
        if self.stream is None:
            self._pending[j] = (self.reducers[j](t), t, None)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = self.reducers[j](t)
            done = torch.cuda.Event()
            done.record(self.stream)
        # ``t`` stays referenced until the wait: its block is not reused while the sum reads it
        self._pending[j] = (out, t, done)

    def ready(self, j: int, t: Tensor) -> None:
        """Half ``j``'s ``t`` is already summed (an MoE module's output): ``wait`` returns it."""
        self._pending[j] = (t, t, None)

    def wait(self, j: int) -> Tensor:
        out, _, done = self._pending[j]
        self._pending[j] = None
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        return out
