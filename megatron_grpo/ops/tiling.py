"""2D tiling of the LM head: row blocks x vocabulary tiles, one fp32 logits tile alive at a time.

A tile is ``[R, Vc]`` fp32 logits with ``R * Vc * 4 <= TILE_BYTES``. Square-ish tiles keep the
GEMMs large and bound the traffic of the fp32 gradient accumulators: with rows outer the
``[R, H]`` d_hidden block is read and written once per vocab tile, and the ``[V_local, H]``
d_weight accumulator once per row block, i.e. ``8 * T * V * H * (1 / R + 1 / Vc)`` bytes.
A 1D row chunk of the whole vocabulary (``R = 384`` at V = 151936 within 256 MiB) made the
d_weight traffic alone ~100 GB at T = 8192.

Only the ``n_valid`` real columns are tiled: padded vocabulary rows are never computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Budget of one fp32 [R, Vc] logits tile (its low-precision gradient is written in place).
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

    @staticmethod
    def plan(n_rows: int, n_cols: int, chunk_size: int | None) -> Tiling:
        """Tile shape for ``n_rows`` active rows and ``n_cols`` valid vocab columns.

        ``chunk_size`` None: square tiles of ``sqrt(TILE_BYTES / 4)`` (8192 at 256 MiB), fewer
        rows when there are fewer. Else ``chunk_size`` rows and as many columns as fit.
        """
        elems = TILE_BYTES // 4
        if chunk_size is None:
            side = round_down(math.isqrt(elems), COL_ALIGN)
            rows = min(side, -(-max(n_rows, 1) // ROW_ALIGN) * ROW_ALIGN)
        else:
            rows = chunk_size
        cols = max(1, round_down(elems // rows, COL_ALIGN))
        return Tiling(rows, min(cols, max(n_cols, 1)), n_rows, n_cols)

    def row_blocks(self) -> list[tuple[int, int]]:
        return [(r, min(r + self.rows, self.n_rows)) for r in range(0, self.n_rows, self.rows)]

    def col_tiles(self) -> list[tuple[int, int]]:
        return [(c, min(c + self.cols, self.n_cols)) for c in range(0, self.n_cols, self.cols)]

    def buffer(self, device: torch.device) -> Tensor:
        """Flat fp32 scratch for one tile (reused by every tile of a pass)."""
        return torch.empty(min(self.rows, self.n_rows) * self.cols, device=device)


def tile_view(buf: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous fp32 [rows, cols] view of the front of a flat scratch buffer."""
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


def merge_tile_stats(parts: list[tuple], rows: int, device: torch.device) -> list[Tensor | None]:
    """Combines per-tile row stats ``(m, s, zt, b)`` (each [R]) into this shard's stats.

    Same algebra as the TP combine: ``M = max m``, ``s = sum s_i exp(m_i - M)`` (likewise b);
    the target logit is in at most one tile (0 elsewhere), so its sum is exact. No tile (an
    all-padded shard) gives the identities (-inf, 0, 0, 0).
    """
    with_b = bool(parts) and parts[0][3] is not None
    if not parts:
        zeros = torch.zeros(rows, device=device)
        return [torch.full_like(zeros, float("-inf")), zeros, zeros.clone(), zeros.clone()]
    if len(parts) == 1:
        return list(parts[0])
    m = torch.stack([p[0] for p in parts])
    big_m = m.amax(0)
    # An all-masked tile would have m = -inf; exp(-inf - M) is 0 but -inf - (-inf) is NaN.
    scale = torch.where(torch.isfinite(m), torch.exp(m - big_m), torch.zeros_like(m))
    s = (torch.stack([p[1] for p in parts]) * scale).sum(0)
    zt = torch.stack([p[2] for p in parts]).sum(0)
    b = (torch.stack([p[3] for p in parts]) * scale).sum(0) if with_b else None
    return [big_m, s, zt, b]
