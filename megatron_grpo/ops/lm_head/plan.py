"""The LM-head plan: every choice of how one call runs, made once by one pure function.

:func:`plan_lm_head` takes what is known before any GEMM (:class:`HeadShape`: active rows, the
shard's shape, dtypes and gradient buffers, the device type) and the caller's options (loss
config, kernel impl, chunk size, memory budget, an optional explicit path) and returns a frozen
:class:`LMHeadPlan`. ``vocab_parallel_logprobs``, ``fused_grpo_loss``, ``GRPOStep``, the memory
plan and the dry run all run or report that plan; ``str(plan)`` explains it in one line.

The decisions, each a field of the plan:

* ``path``: "op" (``vocab_parallel_logprobs``, then ``grpo_loss``), "fused_tiled" (stats pass,
  loss, recompute in backward: 4 GEMMs), "fused_single_pass" (3 GEMMs per full-width chunk, the
  loss inside) or "megatron" (Megatron's output layer + ``vocab_parallel_cross_entropy``, only
  run by ``GRPOStep``). Requests: ``"fused"`` (or None with a loss) picks between the fused paths
  by the single-pass rule below; log-probs alone (no loss) run "op". GSPO (``ratio_level ==
  "sequence"``): a token's ratio is its sequence's mean log-ratio, so every log-prob of a
  sequence comes before any gradient: ``"fused"`` runs "fused_tiled" (all rows' stats, the loss
  at once, the recompute backward), "fused_single_pass" (the loss chunk by chunk) raises.
* ``impl``: the kernel seam, "torch" or "triton" (``ops.kernels.resolve_impl``).
* ``gemm``: how the logits GEMM meets the softmax work. "fused_epilogue": the GEMM reduces its
  fp32 accumulator in registers (``kernels.head_gemm``): the stats pass writes no logits at all,
  the recompute writes d logits in the GEMM dtype, the single pass keeps shifted logits in the
  GEMM dtype. "separate": a cuBLAS GEMM writes fp32 logits tiles that the stats / gradient
  kernels then read. ``auto``: "fused_epilogue" with the triton kernels, else "separate".
* ``weight_grad``: where d_weight goes: "accumulate_fp32" (in place in an fp32 buffer that is
  the gradient: an fp32 ``main_grad``, or the fp32 gradient of an fp32 weight), "write_tiles" (a
  new gradient in the weight's dtype: each vocab tile summed in fp32, written once), "add_tiles"
  (a ``main_grad`` that is not fp32: each tile summed in fp32, added once) or "none".
* ``accumulator`` (single pass only): where the chunks' d_weight sums run: "in_place" (the
  "accumulate_fp32" buffer), "split" (a bf16 weight's new gradient with an int8 residual,
  ``kernels.split_accumulator``: fp32-grade sums for 1 byte per element over the gradient) or
  "fp32" (an extra fp32 [V_local, H] buffer: other dtypes, a low-precision ``main_grad``).
* ``loop_order`` of the tiled backward: "rows_outer" where d_weight accumulates in place
  ("accumulate_fp32" / "none"), else "vocab_outer" (see ``ops.lm_head.passes``).
* chunk sizes: ``tile_rows x tile_cols`` tiles of the tiled passes (fp32 logits, or d logits
  in the GEMM dtype with "fused_epilogue"; also the single pass's recompute), ``chunk_rows``
  full-width rows per single-pass chunk.

The memory budget (``memory_budget`` bytes, default 1 GiB) is the knob that trades memory for
speed: one fp32 logits tile gets ``memory_budget / TILE_FRACTION`` (256 MiB by default), the rest
covers what grows with it (the fp32 d_hidden block / d_weight tile of the tiled backward; on the
single pass the accumulator's bytes beyond the gradient, then the chunks).
A larger budget means larger tiles (less accumulator traffic, ``8 T V H (1/R + 1/Vc)`` bytes)
and makes the single pass possible on wider shards; a smaller one less memory. At the default,
V_local = 151936, H = 4096, bf16, the peak beyond the gradients measured on an H200 is 0.38 GiB
(T = 8192) and 0.88 GiB (T = 32768 without an fp32 main_grad): within 1 GiB.

The single-pass rule (measurements: docs/benchmarks.md): the accumulator's extra bytes
(:func:`accumulator_of`) come out of the budget first (with the "separate" GEMM: they must fit
``ACCUMULATOR_TILES`` tiles), a full-width chunk must fit the rest (the fused epilogue: bf16
shifted logits; "separate": an fp32 [C, V_local] chunk in the tile; C = ``chunk_size``, or as
many 64-aligned rows as fit), and C >= min(``single_pass_min_rows``, rows) (automatic:
:data:`SINGLE_PASS_MIN_ROWS` of the GEMM mode, at least :data:`SPLIT_MIN_ROWS` with the split
accumulator). It reads only values equal on all TP ranks (V_local, not the rank's valid
columns), so every rank takes the same path. An explicit
``path="fused_single_pass"`` skips the row threshold but not the memory checks (ValueError).
Without gradients or loss rows both fused paths are the same stats pass: "fused_tiled" runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.ops.kernels import resolve_impl
from megatron_grpo.ops.lm_head.options import (  # noqa: F401 (the plan's public names too)
    DEFAULT_MEMORY_BUDGET,
    GEMMS,
    PATHS,
    REQUESTS,
    TILE_FRACTION,
    LMHeadOptions,
    is_int,
)
from megatron_grpo.ops.lm_head.reference import STATS_BLOCK
from megatron_grpo.ops.lm_head.tiling import ROW_ALIGN, Tiling, round_down
from megatron_grpo.ops.lm_head.weight_grad import main_grad_of

WEIGHT_GRADS = ("none", "accumulate_fp32", "write_tiles", "add_tiles")
LOOP_ORDERS = ("rows_outer", "vocab_outer")
ACCUMULATORS = ("in_place", "split", "fp32")

# Smallest full-width chunk worth the single pass (auto), per GEMM mode (ops/lm_head/fused_grpo.py).
SINGLE_PASS_MIN_ROWS = {"separate": 4096, "fused_epilogue": 1024}
# ... and with the split accumulator, whose pair is read + written once per chunk (measured on
# an H200, bf16 weight, no main_grad, x = time over the floor at T = 8192 / 32768: 1344-row
# chunks (1 GiB) 1.46x / 1.45x against the tiled path's 1.32x / 1.42x; 8192 / 11136-row chunks
# (4 GiB) 1.23x / 1.21x).
SPLIT_MIN_ROWS = 4096
ACCUMULATOR_TILES = 1  # with the "separate" GEMM: the accumulator's extra bytes, in tiles
_GIB, _MIB = 2**30, 2**20
_SEQUENCE_REASON = (  # why a sequence ratio's automatic request runs "fused_tiled"
    "loss.ratio_level 'sequence' (GSPO): all rows' log-probs, the loss, then the recompute backward"
)


@dataclass(frozen=True)
class HeadShape:
    """What the plan knows of a call: plain values, no tensors."""

    rows: int  # active rows through the LM head (the loss rows, the op's ``rows``)
    v_local: int  # rows of this rank's weight shard (padded vocabulary)
    n_valid: int  # real vocabulary rows of the shard (the others are padding)
    hidden: int  # H
    dtype: torch.dtype  # of the weight (and hidden): the GEMM dtype
    main_grad_dtype: torch.dtype | None  # weight.main_grad's; None: autograd's weight.grad
    device_type: str
    want_dh: bool = True
    want_dw: bool = True

    @staticmethod
    def of(
        weight: Tensor,
        *,
        rows: int,
        n_valid: int | None = None,
        want_dh: bool = True,
        want_dw: bool | None = None,
    ) -> HeadShape:
        """The shape of a [V_local, H] ``weight`` (its ``main_grad``, device); ``n_valid``
        None = V_local; ``want_dw`` None = ``weight.requires_grad``."""
        main_grad = main_grad_of(weight)
        v_local, hidden = weight.shape
        return HeadShape(
            rows=rows,
            v_local=v_local,
            n_valid=v_local if n_valid is None else n_valid,
            hidden=hidden,
            dtype=weight.dtype,
            main_grad_dtype=None if main_grad is None else main_grad.dtype,
            device_type=weight.device.type,
            want_dh=want_dh,
            want_dw=weight.requires_grad if want_dw is None else want_dw,
        )


@dataclass(frozen=True)
class LMHeadPlan:
    """How one call runs (module docstring); ``str(plan)`` explains it in one line. Fields that
    do not apply are None ("megatron" runs Megatron's own code; ``chunk_rows`` is the single
    pass's)."""

    path: str
    reason: str  # why this path
    impl: str | None
    gemm: str | None
    weight_grad: str | None
    loop_order: str | None
    rows: int
    n_valid: int
    tile_rows: int | None
    tile_cols: int | None
    chunk_rows: int | None
    memory_budget: int
    dtype: torch.dtype = torch.float32  # the GEMM dtype (the weight's)
    accumulator: str | None = None  # the single pass's d_weight sums (module docstring)
    accumulator_bytes: int = 0  # what that accumulator holds beyond the gradient

    @property
    def tile_bytes(self) -> int:
        return self.memory_budget // TILE_FRACTION

    def tiling(self) -> Tiling:
        """The tiles of the tiled passes over ``rows`` x ``n_valid``."""
        if self.tile_rows is None or self.tile_cols is None:
            raise ValueError(f"path {self.path!r} has no tiles")
        return Tiling(self.tile_rows, self.tile_cols, self.rows, self.n_valid, self.tile_dtype)

    @property
    def tile_dtype(self) -> torch.dtype:
        """Of a tile (and a single-pass chunk): the GEMM dtype with the fused epilogue."""
        return self.dtype if self.gemm == "fused_epilogue" else torch.float32

    def describe(self) -> str:
        parts = [f"{self.path} ({self.reason})"]
        if self.impl is not None:
            parts.append(f"{self.impl} kernels, {self.gemm.replace('_', ' ')} GEMM")
        if self.chunk_rows is not None:
            kept = "shifted" if self.gemm == "fused_epilogue" else "fp32"
            parts.append(
                f"{self.chunk_rows}-row full-width chunks of {self.n_valid} {kept} logit columns"
            )
        if self.tile_rows is not None:
            what = "recompute tiles" if self.chunk_rows is not None else "tiles"
            parts.append(f"{self.rows} rows in {self.tile_rows} x {self.tile_cols} {what}")
            parts.append(f"backward {self.loop_order.replace('_', ' ')}")
        if self.weight_grad is not None:
            extra = _ACCUMULATOR_WORDS.get(self.accumulator, "")
            parts.append(f"d_weight {self.weight_grad}{extra}")
        budget = f"memory budget {self.memory_budget / _GIB:.3g} GiB"
        return "; ".join(parts + [f"{budget} (tile {self.tile_bytes / _MIB:.4g} MiB)"])

    __str__ = describe


_ACCUMULATOR_WORDS = {
    "in_place": " (summed in place)",
    "split": " (summed as bf16 + int8 residual)",
    "fp32": " (summed in an extra fp32 [V_local, H] buffer)",
}


def accumulator_of(shape: HeadShape, weight_grad: str) -> tuple[str | None, int]:
    """(the single pass's d_weight accumulator, its bytes beyond the gradient) for a plan's
    ``weight_grad`` (module docstring)."""
    if weight_grad == "none":
        return None, 0
    if weight_grad == "accumulate_fp32":
        return "in_place", 0
    if weight_grad == "write_tiles" and shape.dtype == torch.bfloat16:
        return "split", shape.v_local * shape.hidden
    return "fp32", 4 * shape.v_local * shape.hidden


def weight_grad_mode(shape: HeadShape) -> str:
    """Where d_weight goes (module docstring): read from the weight's dtype and main_grad."""
    if not shape.want_dw:
        return "none"
    target = shape.main_grad_dtype if shape.main_grad_dtype is not None else shape.dtype
    if target == torch.float32:
        return "accumulate_fp32"
    return "write_tiles" if shape.main_grad_dtype is None else "add_tiles"


class HeadRequest(NamedTuple):
    """A resolved LM-head request, decided once (:func:`resolve_request`) and carried as a
    value into the plans of the calls it serves: ``path`` "op", "megatron", "fused" (the plan
    picks a fused path), "fused_tiled" or "fused_single_pass"; ``reason``: why."""

    path: str
    reason: str


OP_REQUEST = HeadRequest("op", "requested")  # the log-prob op's own request


def resolve_request(path: str | None, loss: GRPOLossConfig | None) -> HeadRequest:
    """The request ``path`` means for ``loss``; raises on impossible ones.

    ``"fused"`` here still has to pick between the fused paths (:func:`plan_lm_head`); a
    sequence ratio's automatic request is already "fused_tiled", so the single pass, which runs
    the loss chunk by chunk, never serves one.
    """
    if path is not None and path not in REQUESTS:
        raise ValueError(f"path must be one of {list(REQUESTS)} or None, got {path!r}")
    if path == "megatron" and loss is not None and loss.entropy_coef != 0:
        raise ValueError(
            "path 'megatron' (vocab_parallel_cross_entropy) computes no entropy; "
            f"loss.entropy_coef must be 0, got {loss.entropy_coef}"
        )
    if path in ("op", "megatron"):
        return HeadRequest(path, "requested")
    if loss is None:
        if path is not None:
            raise ValueError(f"path {path!r} fuses the loss: it needs a loss config")
        return HeadRequest("op", "log-probs only")
    if loss.needs_whole_sequences():  # GSPO
        if path == "fused_single_pass":
            raise ValueError(
                "path 'fused_single_pass' runs the loss chunk by chunk, but loss.ratio_level "
                "'sequence' (GSPO) needs all of a sequence's log-probs before any gradient: use "
                "path 'fused' / 'fused_tiled' or 'op'"
            )
        if path in (None, "fused"):
            return HeadRequest("fused_tiled", _SEQUENCE_REASON)
    return (
        HeadRequest("fused", "auto") if path in (None, "fused") else HeadRequest(path, "requested")
    )


def plan_lm_head(
    shape: HeadShape,
    options: LMHeadOptions | None = None,
    *,
    loss: GRPOLossConfig | None = None,
    request: HeadRequest | None = None,
    single_pass_min_rows: int | None = None,
    **overrides: object,
) -> LMHeadPlan:
    """The plan of one call (module docstring). Deterministic: equal arguments, equal plans.

    Args:
        shape: the call's rows, shard and gradient buffers (:meth:`HeadShape.of`).
        options: the path request (None / "fused": automatic, or one of :data:`PATHS`), kernel
            impl, GEMM mode, chunk size and memory budget (:class:`LMHeadOptions`; its
            temperature and vocab size do not change the plan).
        loss: the GRPO loss config (its ``ratio_level``), None for log-probs alone.
        request: the request already resolved (:func:`resolve_request`, once per step or
            call); None = resolved here from ``options.path`` and ``loss``.
        single_pass_min_rows: the automatic rule's row threshold; None =
            :data:`SINGLE_PASS_MIN_ROWS` of the GEMM mode.
        overrides: :class:`LMHeadOptions` fields by keyword (``path=``, ``memory_budget=``...).
    """
    opts = LMHeadOptions.of(options, **overrides)
    min_rows = single_pass_min_rows
    if min_rows is not None and (not is_int(min_rows) or min_rows < 0):
        raise ValueError(f"single_pass_min_rows must be an int >= 0, got {min_rows!r}")
    request = request or resolve_request(opts.path, loss)
    if request.path == "megatron":
        return LMHeadPlan(
            "megatron",
            request.reason,
            None,
            None,
            None,
            None,
            shape.rows,
            shape.n_valid,
            None,
            None,
            None,
            opts.budget,
            shape.dtype,
        )
    return _kernel_plan(shape, opts, request, min_rows)


def _kernel_plan(
    shape: HeadShape, opts: LMHeadOptions, request: HeadRequest, min_rows: int | None
) -> LMHeadPlan:
    """The plan of a request the LM-head op runs (not "megatron")."""
    budget, weight_grad = opts.budget, weight_grad_mode(shape)
    impl_name = resolve_impl(opts.impl, shape.device_type)
    gemm_name = resolve_gemm(opts.gemm, impl_name)
    tile_dtype = shape.dtype if gemm_name == "fused_epilogue" else torch.float32
    tiling = Tiling.plan(
        shape.rows, shape.n_valid, opts.chunk_size, budget // TILE_FRACTION, tile_dtype
    )
    path, reason, chunk_rows = request.path, request.reason, None
    if path != "op":
        if min_rows is None:
            min_rows = SINGLE_PASS_MIN_ROWS[gemm_name]
            if accumulator_of(shape, weight_grad)[0] == "split":  # pays per chunk: big ones
                min_rows = max(min_rows, SPLIT_MIN_ROWS)
        path, chunk_rows, reason = _fused_path(
            path, reason, shape, weight_grad, opts.chunk_size, budget, gemm_name, min_rows
        )
    loop = "rows_outer" if weight_grad in ("none", "accumulate_fp32") else "vocab_outer"
    acc, acc_bytes = None, 0
    if path == "fused_single_pass":
        acc, acc_bytes = accumulator_of(shape, weight_grad)
    return LMHeadPlan(
        path,
        reason,
        impl_name,
        gemm_name,
        weight_grad,
        loop,
        shape.rows,
        shape.n_valid,
        tiling.rows,
        tiling.cols,
        chunk_rows,
        budget,
        shape.dtype,
        acc,
        acc_bytes,
    )


def resolve_gemm(gemm: str, impl: str) -> str:
    """The GEMM mode ``gemm`` (validated by :class:`LMHeadOptions`) means with kernels
    ``impl`` (module docstring)."""
    if gemm == "auto":
        return "fused_epilogue" if impl == "triton" else "separate"
    return gemm


def _fused_path(
    request: str,
    reason: str,
    shape: HeadShape,
    weight_grad: str,
    chunk_size: int | None,
    budget: int,
    gemm: str,
    min_rows: int,
) -> tuple[str, int | None, str]:
    """(path, single-pass chunk rows or None, why) of a fused request of :func:`resolve_request`
    (with its ``reason``): "fused_tiled" stays tiled (a sequence ratio's request is that)."""
    if not (shape.want_dh or shape.want_dw):
        return "fused_tiled", None, "no gradient wanted: the stats pass"
    if shape.rows == 0:
        return "fused_tiled", None, "no loss rows"
    if request == "fused_tiled":
        return "fused_tiled", None, reason
    if gemm == "fused_epilogue":
        rows, why_not = _epilogue_chunk(shape, weight_grad, chunk_size, budget)
    else:
        rows, why_not = _single_pass_chunk(shape, weight_grad, chunk_size, budget // TILE_FRACTION)
    if why_not is not None and request == "fused_single_pass":
        raise ValueError(
            f"path 'fused_single_pass' does not fit the memory budget: {why_not}; "
            "raise memory_budget or lower chunk_size"
        )
    if why_not is not None:
        return "fused_tiled", None, f"auto: {why_not}"
    if request == "fused_single_pass":
        return request, min(rows, shape.rows), "requested"
    threshold = min(min_rows, shape.rows)
    if rows < threshold:
        why = f"auto: full-width chunks of {rows} rows < min({min_rows}, {shape.rows} rows)"
        return "fused_tiled", None, why
    why = f"auto: full-width chunks of {rows} rows >= min({min_rows}, {shape.rows} rows)"
    return "fused_single_pass", min(rows, shape.rows), why


def _epilogue_chunk(
    shape: HeadShape, weight_grad: str, chunk_size: int | None, budget: int
) -> tuple[int, str | None]:
    """(rows per full-width chunk, None) when the fused-epilogue single pass fits ``budget``
    bytes, else (rows, why not). Per chunk row it keeps the shifted logits (GEMM dtype), the
    block statistics and an fp32 d_hidden row; the d_weight accumulator's bytes beyond the
    gradient (:func:`accumulator_of`) come out of the budget first."""
    kind, extra = accumulator_of(shape, weight_grad)
    elem = torch.empty((), dtype=shape.dtype).element_size()
    blocks = -(-shape.v_local // STATS_BLOCK)
    per_row = elem * shape.v_local + 16 * blocks + 4 * shape.hidden
    fit = max(budget - extra, 0) // per_row
    rows = round_down(fit, ROW_ALIGN) if chunk_size is None else chunk_size
    if extra and fit < ROW_ALIGN:
        return rows, (
            f"its {kind} d_weight accumulator ({extra} bytes beyond the gradient) "
            f"leaves no room for a chunk in the {budget}-byte budget"
        )
    if not 1 <= rows <= fit:
        return rows, (
            f"a full-width chunk of {max(rows, 1)} x {shape.v_local} "
            f"({per_row} bytes a row) exceeds the {budget}-byte budget"
        )
    return rows, None


def _single_pass_chunk(
    shape: HeadShape, weight_grad: str, chunk_size: int | None, tile: int
) -> tuple[int, str | None]:
    """(rows per full-width chunk, None) when the single pass fits ``tile`` bytes, else
    (rows, why not)."""
    fit = tile // (4 * max(shape.v_local, 1))
    rows = round_down(fit, ROW_ALIGN) if chunk_size is None else chunk_size
    if not 1 <= rows <= fit:
        return rows, (
            f"a full-width fp32 chunk of {max(rows, 1)} x {shape.v_local} exceeds the "
            f"{tile}-byte tile"
        )
    kind, extra = accumulator_of(shape, weight_grad)
    if extra > ACCUMULATOR_TILES * tile:
        return rows, (
            f"its {kind} d_weight accumulator ({extra} bytes beyond the gradient) "
            f"exceeds {ACCUMULATOR_TILES} tile of {tile} bytes"
        )
    return rows, None
