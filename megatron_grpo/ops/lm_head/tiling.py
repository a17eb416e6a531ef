"""2D tiling of the LM head: row blocks x vocabulary tiles, one fp32 logits tile alive at a time.

A tile is ``[R, Vc]`` fp32 logits with ``R * Vc * 4 <= tile_bytes`` (the plan's share of its memory
budget, :mod:`megatron_grpo.ops.lm_head.plan`; ``TILE_BYTES`` at the default budget). Square-ish tiles keep
the GEMMs large and bound the traffic of the fp32 gradient accumulators: with rows outer the
``[R, H]`` d_hidden block is read and written once per vocab tile, and the ``[V_local, H]``
d_weight accumulator once per row block, i.e. ``8 * T * V * H * (1 / R + 1 / Vc)`` bytes. A 1D row
chunk of the whole vocabulary (``R = 384`` at V = 151936 within 256 MiB) made the d_weight traffic
alone ~100 GB at T = 8192.

Only the ``n_valid`` real columns are tiled: padded vocabulary rows are never computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_grpo.ops.lm_head.stats import OVER_TILES, RowStats, merge_row_stats

# One fp32 [R, Vc] logits tile at the default memory budget (its low-precision gradient is
# written in place); ops.lm_head.plan derives the tile of any other budget.
TILE_BYTES = 256 * 2**20
ROW_ALIGN = 64
COL_ALIGN = 256


def round_down(x: int, align: int) -> int:
    return x // align * align if x >= align else x


@dataclass(frozen=True)
class Tiling:
    """Row blocks of ``rows`` and vocab tiles of ``cols`` over ``n_rows`` x ``n_cols``."""

    rows: int
    cols: int
    n_rows: int
    n_cols: int
    dtype: torch.dtype = torch.float32  # of the tile: fp32 logits, or the GEMM dtype's d logits

    @staticmethod
    def plan(
        n_rows: int,
        n_cols: int,
        chunk_size: int | None,
        tile_bytes: int = TILE_BYTES,
        dtype: torch.dtype = torch.float32,
    ) -> Tiling:
        """Tile shape for ``n_rows`` active rows and ``n_cols`` valid vocab columns.

        ``chunk_size`` None: square tiles of ``sqrt(tile_bytes / element size)`` (8192 fp32 at
        256 MiB), fewer rows when there are fewer. Else ``chunk_size`` rows and as many columns
        as fit.
        """
        elems = tile_bytes // torch.empty((), dtype=dtype).element_size()
        if chunk_size is None:
            side = round_down(math.isqrt(elems), COL_ALIGN)
            rows = min(side, -(-max(n_rows, 1) // ROW_ALIGN) * ROW_ALIGN)
        else:
            rows = chunk_size
        cols = max(1, round_down(elems // rows, COL_ALIGN))
        return Tiling(rows, min(cols, max(n_cols, 1)), n_rows, n_cols, dtype)

    def row_blocks(self) -> list[tuple[int, int]]:
        return [(r, min(r + self.rows, self.n_rows)) for r in range(0, self.n_rows, self.rows)]

    def col_tiles(self) -> list[tuple[int, int]]:
        return [(c, min(c + self.cols, self.n_cols)) for c in range(0, self.n_cols, self.cols)]

    def buffer(self, device: torch.device) -> Tensor:
        """Flat scratch for one tile (reused by every tile of a pass)."""
        return torch.empty(min(self.rows, self.n_rows) * self.cols, dtype=self.dtype, device=device)


def tile_view(buf: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous [rows, cols] view (buf's dtype) of the front of a flat scratch buffer."""
    return buf[: rows * cols].view(rows, cols)


def narrow_alias(logits: Tensor, dtype: torch.dtype) -> Tensor:
    """A ``dtype`` [R, Vc] view over the fp32 logits' memory, row r inside fp32 row r.

    Row r of the view occupies the first half of fp32 row r's bytes, so the gradient kernel can
    write it while it streams the logits row (see ``megatron_grpo.kernels.logits_grad``).
    """
    if dtype == logits.dtype:
        return logits
    if torch.empty((), dtype=dtype).element_size() > logits.element_size():
        return torch.empty_like(logits, dtype=dtype)  # float64: no room inside fp32 rows
    return logits.view(dtype)[:, : logits.shape[1]]


def merge_tile_stats(
    parts: list[RowStats], rows: int, device: torch.device, with_b: bool
) -> RowStats:
    """Combines per-tile row stats (each [R]) into this shard's stats: the log-sum-exp merge
    (:func:`megatron_grpo.ops.lm_head.stats.merge_row_stats`) over the stacked tiles. One tile is its
    own merge; no tile (an all-padded shard) gives the identities (-inf, 0, 0, 0)."""
    if not parts:
        return RowStats.identity(rows, device, with_b)
    if len(parts) == 1:
        return parts[0]
    return merge_row_stats(RowStats.stack(parts), OVER_TILES)
