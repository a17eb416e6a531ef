"""The vocab-parallel LM head shared by the log-prob op and the fused GRPO path.

Logits are computed in 2D tiles (:mod:`megatron_grpo.ops.lm_head.tiling`): ``[R, Vc]`` fp32, the only
vocabulary-sized tensor alive. The three GEMMs (logits, d_hidden, d_weight) run through torch
(cuBLAS on GPU) with fp32 results; the per-tile softmax work goes through the kernel seam
(:mod:`megatron_grpo.ops.lm_head.reference` or ``megatron_grpo.kernels``), which sees each vocab tile as
a shard of ``Vc`` valid columns. How a call runs (tiles, kernels, paths) is its
:class:`megatron_grpo.ops.lm_head.plan.LMHeadPlan`, the head is built with (:func:`build_lm_head`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megatron_grpo.loss.checks import DeviceCheck, fetch
from megatron_grpo.loss.math import true_positions
from megatron_grpo.ops.lm_head.comm import TPInfo
from megatron_grpo.ops.lm_head.gemm import mm_f32
from megatron_grpo.ops.lm_head.options import LMHeadOptions
from megatron_grpo.ops.lm_head.reference import STATS_BLOCK
from megatron_grpo.ops.lm_head.seam import Kernels, kernels_named
from megatron_grpo.ops.lm_head.stats import OVER_TILES, RowGrads, RowStats, merge_row_stats
from megatron_grpo.ops.lm_head.tiling import narrow_alias, tile_view

if TYPE_CHECKING:
    from megatron_grpo.ops.lm_head.plan import LMHeadPlan


@dataclass(frozen=True)
class LMHead:
    """A validated vocab-parallel LM head shard and how to run it tile by tile.

    ``weight`` is this rank's [V_local, H] shard: rows ``[vocab_start, vocab_start + V_local)``
    of the padded vocabulary, of which the first ``n_valid`` are real tokens (only those are
    tiled). ``plan`` / ``kernels``: the call's plan and its kernel seam (:func:`build_lm_head`
    builds it once, with both).
    """

    weight: Tensor
    tp: TPInfo
    sequence_parallel: bool
    vocab_size: int
    vocab_start: int
    n_valid: int
    inv_temperature: float
    plan: LMHeadPlan
    kernels: Kernels

    def logits(self, h: Tensor, start: int, stop: int, buf: Tensor) -> Tensor:
        """[R, H] -> raw fp32 logits [R, stop - start] of vocab rows ``start:stop``, in ``buf``
        (temperature is applied by the kernels)."""
        out = tile_view(buf, h.shape[0], stop - start)
        return mm_f32(h, self.weight[start:stop].t(), out=out)

    def stats(self, logits: Tensor, t_local: Tensor, start: int, with_entropy: bool) -> RowStats:
        """Row stats of a tile starting at vocab row ``start``."""
        return RowStats(
            *self.kernels.logits_row_stats(
                logits, t_local - start, logits.shape[1], self.inv_temperature, with_entropy
            )
        )

    @property
    def epilogue(self) -> bool:
        """Whether the plan runs the logits GEMM with the softmax work as its epilogue."""
        return self.plan.gemm == "fused_epilogue"

    def tile_stats(
        self, h: Tensor, t_local: Tensor, start: int, stop: int, with_entropy: bool, buf: Tensor
    ) -> RowStats:
        """Row stats of vocab rows ``start:stop`` for the rows ``h`` ([R, H]): the fused GEMM's
        per-block statistics merged, or fp32 logits in ``buf`` reduced by the stats kernel."""
        if not self.epilogue:
            return self.stats(self.logits(h, start, stop, buf), t_local, start, with_entropy)
        parts = self.kernels.head_gemm_stats(
            h, self.weight[start:stop], t_local - start, self.inv_temperature, with_entropy
        )
        return merge_row_stats(RowStats(*parts), OVER_TILES)

    def tile_dlogits(
        self, h: Tensor, t_local: Tensor, start: int, stop: int, g: RowGrads, buf: Tensor
    ) -> Tensor:
        """d loss / d logits [R, stop - start] in the GEMM dtype of vocab rows ``start:stop``,
        written in ``buf``: straight from the fused GEMM, or by recompute + gradient kernel."""
        if not self.epilogue:
            return self.dlogits(self.logits(h, start, stop, buf), t_local, start, g)
        out = tile_view(buf, h.shape[0], stop - start)
        return self.kernels.head_gemm_grad(
            h,
            self.weight[start:stop],
            t_local - start,
            self.inv_temperature,
            g.lse,
            g.g_logp,
            g.g_ent,
            g.pz,
            out=out,
        )

    def shifted_stats(
        self, h: Tensor, t_local: Tensor, with_entropy: bool, buf: Tensor
    ) -> tuple[RowStats, Tensor]:
        """Row stats of every valid column for the rows ``h`` ([C, H]) by the fused GEMM, which
        also keeps the shifted logits ``z - m_block`` in ``buf`` (GEMM dtype, [C, n_valid]);
        returns (stats, the per-block shifts ``m`` [NB, C]) for :meth:`shifted_dlogits`."""
        out = tile_view(buf, h.shape[0], self.n_valid)
        parts = RowStats(
            *self.kernels.head_gemm_stats(
                h,
                self.weight[: self.n_valid],
                t_local,
                self.inv_temperature,
                with_entropy,
                shifted=out,
            )
        )
        return merge_row_stats(parts, OVER_TILES), parts.m

    def shifted_dlogits(self, shifted: Tensor, t_local: Tensor, shift: Tensor, g: RowGrads):
        """d loss / d logits of :meth:`shifted_stats`'s ``[C, n_valid]`` shifted logits, written
        over them (GEMM dtype)."""
        return self.kernels.logits_grad(
            shifted,
            t_local,
            self.n_valid,
            self.inv_temperature,
            g.lse,
            g.g_logp,
            g.g_ent,
            g.pz,
            out=shifted,
            block_shift=shift,
            shift_block=STATS_BLOCK,
        )

    def dlogits(self, logits: Tensor, t_local: Tensor, start: int, g: RowGrads) -> Tensor:
        """d loss / d logits of a tile in the GEMM dtype (the weight's), written over ``logits``.

        fp32 weights: in place. Low precision: rounded to the weight dtype like the input of
        any bf16 GEMM, into the first half of each fp32 row (row stride 2 * Vc elements); the
        GEMMs then accumulate in fp32.
        """
        out = narrow_alias(logits, self.weight.dtype)
        return self.kernels.logits_grad(
            logits,
            t_local - start,
            logits.shape[1],
            self.inv_temperature,
            g.lse,
            g.g_logp,
            g.g_ent,
            g.pz,
            out=out,
        )


@dataclass(frozen=True)
class HeadShard:
    """This rank's rows ``[vocab_start, vocab_start + V_local)`` of the padded vocabulary, the
    first ``n_valid`` of them real tokens (``vocab_size``: the real vocabulary)."""

    vocab_size: int
    vocab_start: int
    n_valid: int


def build_lm_head(
    weight: Tensor,
    shard: HeadShard,
    plan: LMHeadPlan,
    options: LMHeadOptions,
    *,
    tp: TPInfo,
    sequence_parallel: bool,
) -> LMHead:
    """The head of ``shard`` (:func:`head_shard`) running ``plan`` (its tiles, loop order and
    ``impl``'s kernels): built once, when its plan is known."""
    if plan.n_valid != shard.n_valid:
        raise ValueError(f"plan for {plan.n_valid} valid columns, shard has {shard.n_valid}")
    return LMHead(
        weight=weight,
        tp=tp,
        sequence_parallel=sequence_parallel and tp.size > 1,
        vocab_size=shard.vocab_size,
        vocab_start=shard.vocab_start,
        n_valid=shard.n_valid,
        inv_temperature=1.0 / float(options.temperature),
        plan=plan,
        kernels=kernels_named(plan.impl),
    )


def head_shard(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    options: LMHeadOptions,
    *,
    tp: TPInfo,
    sequence_parallel: bool,
) -> HeadShard:
    """Validates the op's inputs against each other (errors name the argument; ``options``
    validated themselves) and describes this rank's shard."""
    _check_shapes(hidden, weight, targets, tp, sequence_parallel)
    vocab_size = options.vocab_size
    v_local = weight.shape[0]
    padded = v_local * tp.size
    if vocab_size is None:
        vocab_size = padded
    if not 1 <= vocab_size <= padded:
        raise ValueError(
            f"vocab_size must be in [1, V_local * TP = {padded}] (padded rows excluded), "
            f"got {vocab_size}"
        )
    start = tp.rank * v_local
    return HeadShard(vocab_size, start, min(max(vocab_size - start, 0), v_local))


def _check_shapes(
    hidden: Tensor, weight: Tensor, targets: Tensor, tp: TPInfo, sequence_parallel: bool
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [T_local, H] and weight [V_local, H], got {list(hidden.shape)} "
            f"and {list(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden H={hidden.shape[1]} != weight H={weight.shape[1]}")
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise ValueError(
            f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, "
            f"{weight.device}) must share dtype and device"
        )
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if targets.dim() != 1 or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(
            f"targets must be an integer [T] tensor, got {targets.dtype} {list(targets.shape)}"
        )
    if targets.device != hidden.device:
        raise ValueError(f"targets is on {targets.device}, hidden on {hidden.device}")
    t_total = hidden.shape[0] * (tp.size if sequence_parallel else 1)
    if targets.shape[0] != t_total:
        sp = f" (sequence_parallel: T_local {hidden.shape[0]} x TP {tp.size})" * sequence_parallel
        raise ValueError(f"targets has {targets.shape[0]} rows, expected T = {t_total}{sp}")


def select_rows(rows: Tensor | None, targets: Tensor, vocab_size: int) -> Tensor | None:
    """Indices [R] of the active rows of a bool ``rows`` [T] (None = all T; also None when every
    row is active), targets checked. One host sync: the row count and the target check are
    fetched together."""
    t_total = targets.shape[0]
    if rows is not None and (
        rows.dtype != torch.bool or rows.shape != (t_total,) or rows.device != targets.device
    ):
        raise ValueError(
            f"rows must be a bool [T={t_total}] tensor on {targets.device}, got {rows.dtype} "
            f"{list(rows.shape)} on {rows.device}"
        )
    mask = torch.ones(t_total, dtype=torch.bool, device=targets.device) if rows is None else rows
    (n,) = fetch([targets_check(targets, mask, vocab_size)], mask.sum())
    # every row: plain slices instead of gathers
    return None if n == t_total else true_positions(mask, n)


def check_targets(targets: Tensor, idx: Tensor | None, vocab_size: int) -> None:
    """Raises naming the first active position whose target is outside [0, vocab_size)."""
    t_sel = targets if idx is None else targets[idx]
    bad = (t_sel < 0) | (t_sel >= vocab_size)
    if t_sel.numel() and bool(bad.any()):  # one host sync
        first = int(bad.nonzero()[0, 0])
        pos = first if idx is None else int(idx[first])
        raise ValueError(
            f"targets[{pos}] = {int(t_sel[first])} is outside [0, vocab_size={vocab_size}) at an "
            "active row (mask such rows out with `rows`)"
        )


def targets_check(targets: Tensor, rows: Tensor, vocab_size: int) -> DeviceCheck:
    """:func:`check_targets` at the True positions of the bool [T] ``rows``, as a device-side
    count for the caller's single host fetch (``loss.checks.fetch``); a failure raises
    :func:`check_targets`'s error."""
    rows = rows.to(targets.device)
    bad = (((targets < 0) | (targets >= vocab_size)) & rows).sum()
    return DeviceCheck(bad, lambda: check_targets(targets, rows.nonzero().squeeze(1), vocab_size))


def take_rows(x: Tensor, idx: Tensor | None, start: int, stop: int) -> Tensor:
    """Rows ``start:stop`` of the active rows of x ([T, ...] -> [stop - start, ...])."""
    return x[start:stop] if idx is None else x[idx[start:stop]]
