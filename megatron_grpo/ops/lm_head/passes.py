"""The two tiled passes over the LM head shared by the log-prob op and the fused GRPO path.

Forward (:func:`forward_stats`): per row block, per vocab tile: fp32 logits GEMM -> tile row
stats (kernel seam) -> merged across tiles, then one TP combine over all active rows. Only
[R]-sized stats survive.

Backward (:func:`backward_grads`): recompute each tile's logits, d logits (kernel seam, in place
in the GEMM dtype), then ``d_hidden += dlogits @ W_tile`` and ``d_weight_tile += dlogits^T @ h``
with fp32 accumulation. The tiles and the loop order are the plan's (``head.plan``,
:mod:`megatron_grpo.ops.lm_head.plan`); the order follows where the fp32 accumulators live:

* rows outer (d_weight accumulated in place in fp32 ``main_grad`` / an fp32 weight's gradient):
  extra memory one tile + an fp32 [R, H] d_hidden block;
* vocab outer (bf16 gradient, no fp32 main_grad): an fp32 [Vc, H] d_weight tile is finished and
  rounded once per vocab tile, d_hidden accumulates in an fp32 [T, H] buffer. Rows outer would
  need a [V_local, H] fp32 accumulator instead (2.3 GiB at V = 151936, H = 4096).

Both orders move ``8 * T * V * H * (1 / R + 1 / Vc)`` bytes of accumulator traffic. Measured on
one H200 (H = 4096, V = 151936, bf16, default 8192 x 8192 tiles), peak memory beyond the
gradients: 0.38 GiB at T = 8192 and 32768 with an fp32 main_grad; without, 0.38 / 0.88 GiB (the
fp32 [T, H] d_hidden of the vocab-outer order is 0.5 GiB at T = 32768).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.ops.lm_head.comm import (
    all_gather_rows,
    all_reduce_sum_,
    combine_row_stats,
    reduce_scatter_rows,
)
from megatron_grpo.ops.lm_head.gemm import mm_f32
from megatron_grpo.ops.lm_head.head import LMHead, take_rows
from megatron_grpo.ops.lm_head.stats import GlobalRowStats, RowGrads, RowStats
from megatron_grpo.ops.lm_head.tiling import Tiling, merge_tile_stats
from megatron_grpo.ops.lm_head.weight_grad import WeightGradSink


def gather_hidden(hidden: Tensor, head: LMHead) -> Tensor:
    """[T_local, H] -> [T, H] under sequence parallelism (identity otherwise)."""
    return all_gather_rows(hidden, head.tp) if head.sequence_parallel else hidden


def local_targets(targets: Tensor, idx: Tensor | None, head: LMHead) -> Tensor:
    """[R] int64 targets of the active rows relative to this shard's first vocab id."""
    sel = targets if idx is None else targets[idx]
    return sel.long() - head.vocab_start


def scatter_rows(values: Tensor, idx: Tensor | None, total: int) -> Tensor:
    """[R] values of the active rows -> [T] float32 with zeros elsewhere."""
    if idx is None:
        return values
    out = values.new_zeros(total)
    return out.index_copy_(0, idx, values)


def plan_tiling(head: LMHead, n_rows: int) -> Tiling:
    """The tiles of ``head.plan``, made for these ``n_rows`` active rows."""
    if head.plan.rows != n_rows:
        raise ValueError(f"the plan is for {head.plan.rows} rows, the pass has {n_rows}")
    return head.plan.tiling()


def forward_stats(
    head: LMHead, h_full: Tensor, idx: Tensor | None, t_local: Tensor, with_entropy: bool
) -> GlobalRowStats:
    """Global stats [R] of the active rows; one logits tile alive at a time."""
    n_rows, dev = t_local.shape[0], h_full.device
    tiling = plan_tiling(head, n_rows)
    local = RowStats.empty(n_rows, dev, with_entropy)
    buf = tiling.buffer(dev)
    # The fused GEMM keeps no logits: one call covers every column of a row block.
    col_tiles = [(0, head.n_valid)] if head.epilogue and head.n_valid else tiling.col_tiles()
    for r0, r1 in tiling.row_blocks():
        h, t_rows = take_rows(h_full, idx, r0, r1), t_local[r0:r1]
        parts = []
        for v0, v1 in col_tiles:
            parts.append(head.tile_stats(h, t_rows, v0, v1, with_entropy, buf))
        local.write(r0, r1, merge_tile_stats(parts, r1 - r0, dev, with_entropy))
    return combine_row_stats(local, head.tp)


class HiddenGrad:
    """d_hidden output: rows put as fp32 blocks; TP-summed and cast by :meth:`finish`.

    TP = 1: written straight into a [T, H] tensor of ``dtype`` (the gradient itself).
    TP > 1: an fp32 [T, H] buffer, reduce-scattered (sequence parallel) or all-reduced.
    ``dtype`` float32 keeps the result in fp32 (the single pass scales it in backward).
    """

    def __init__(self, head: LMHead, h_full: Tensor, idx: Tensor | None, dtype: torch.dtype):
        self.head, self.idx, self.dtype = head, idx, dtype
        store = torch.float32 if head.tp.size > 1 else dtype
        # Every row is put when all rows are active: no zero fill then.
        alloc = torch.empty if idx is None else torch.zeros
        self.buf = alloc(h_full.shape, dtype=store, device=h_full.device)

    def put(self, start: int, stop: int, dh: Tensor) -> None:
        if self.idx is None:
            self.buf[start:stop] = dh
        else:
            self.buf.index_copy_(0, self.idx[start:stop], dh.to(self.buf.dtype))

    def finish(self) -> Tensor:
        tp = self.head.tp
        if self.head.sequence_parallel:
            return reduce_scatter_rows(self.buf, tp).to(self.dtype)
        return all_reduce_sum_(self.buf, tp).to(self.dtype)


def backward_grads(
    head: LMHead,
    hidden: Tensor,
    idx: Tensor | None,
    t_local: Tensor,
    grads: RowGrads,
    sink: WeightGradSink | None,
    want_dh: bool,
) -> Tensor | None:
    """Recomputes every tile in the plan's loop order; lands d_weight in ``sink`` and returns
    d_hidden [T_local, H] in the hidden dtype (TP-reduced), or None when not ``want_dh``."""
    h_full = gather_hidden(hidden, head)
    tiling = plan_tiling(head, t_local.shape[0])
    dh = HiddenGrad(head, h_full, idx, hidden.dtype) if want_dh else None
    rows_outer = head.plan.loop_order == "rows_outer"
    if sink is not None and sink.direct != rows_outer:
        raise RuntimeError(f"loop order {head.plan.loop_order} with a direct={sink.direct} sink")
    if rows_outer:
        _rows_outer(head, tiling, h_full, idx, t_local, grads, sink, dh)
    else:
        _vocab_outer(head, tiling, h_full, idx, t_local, grads, sink, dh)
    return None if dh is None else dh.finish()


def _rows_outer(head, tiling: Tiling, h_full, idx, t_local, grads, sink, dh_out) -> None:
    buf, w = tiling.buffer(h_full.device), head.weight
    for r0, r1 in tiling.row_blocks():
        h, t_rows, g = take_rows(h_full, idx, r0, r1), t_local[r0:r1], grads.rows(r0, r1)
        dh = None  # fp32 [R, H], started by the first tile's GEMM
        for v0, v1 in tiling.col_tiles():
            dlogits = head.tile_dlogits(h, t_rows, v0, v1, g, buf)
            if dh_out is not None:
                dh = mm_f32(dlogits, w[v0:v1], acc=dh)
            if sink is not None:
                mm_f32(dlogits.t(), h, acc=sink.tile(v0, v1))
        if dh_out is not None:
            dh_out.put(r0, r1, _or_zeros(dh, (r1 - r0, h.shape[1]), h.device))


def _or_zeros(x: Tensor | None, shape: tuple[int, int], device: torch.device) -> Tensor:
    """``x``, or fp32 zeros when no tile produced it (an all-padded shard)."""
    return torch.zeros(shape, device=device) if x is None else x


def _vocab_outer(head, tiling: Tiling, h_full, idx, t_local, grads, sink, dh_out) -> None:
    buf, w, n_rows = tiling.buffer(h_full.device), head.weight, t_local.shape[0]
    tiles, blocks = tiling.col_tiles(), tiling.row_blocks()
    dh = None
    if dh_out is not None:  # fp32 [T, H]: the first vocab tile's GEMMs write it
        alloc = torch.empty if tiles else torch.zeros
        dh = alloc((n_rows, h_full.shape[1]), dtype=torch.float32, device=h_full.device)
    for v0, v1 in tiles:
        acc = None  # fp32 [Vc, H] sum over row blocks; one block goes straight to the sink
        for r0, r1 in blocks:
            h = take_rows(h_full, idx, r0, r1)
            dlogits = head.tile_dlogits(h, t_local[r0:r1], v0, v1, grads.rows(r0, r1), buf)
            if dh is not None and v0 == 0:
                mm_f32(dlogits, w[v0:v1], out=dh[r0:r1])
            elif dh is not None:
                mm_f32(dlogits, w[v0:v1], acc=dh[r0:r1])
            if len(blocks) == 1:
                sink.add_product(v0, v1, dlogits.t(), h)
            else:
                acc = mm_f32(dlogits.t(), h, acc=acc)
        if acc is not None:
            sink.commit(v0, v1, acc)
    if dh is not None:
        dh_out.put(0, n_rows, dh)
