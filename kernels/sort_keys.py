"""A stable counting sort of small integer keys in one launch: MoE (token, slot) pairs by expert.

The key of pair ``p`` is ``ids[p] - offset`` where that lies in ``[0, K)`` (a local expert), else
``K`` (another rank's expert: sorted last). Pair ``p`` lands at

    pos[p] = #{q : key[q] < key[p]} + #{q < p : key[q] == key[p]}

which every program computes for its block of pairs by comparing it with all ``N`` keys, one
``[BLOCK_P, BLOCK_Q]`` tile at a time (int32 keys; tiles small enough to stay in registers):
``O(N^2)`` comparisons, no atomics, no host sync and no cross-program dependency, so it is
deterministic and fits a CUDA graph. Meant for decode-sized ``N``, where ``torch.argsort`` (a
multi-pass radix sort) plus the inverse scatter and the per-expert counts take several launches;
``ops.layers.sort_keys`` picks it where ``tools/bench_moe_sort.py`` measured it ahead.
Programs past the pair blocks count the pairs of each key in ``[0, K)``, ``BLOCK_P`` keys each.
"""

from __future__ import annotations

import functools

import torch

from ._runtime import check_device, interpret_mode, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the launcher raises a clear error on use
    triton = None
    tl = None

NUM_WARPS = 4
# (pairs a program places = keys a counting program counts, keys compared a step) by pair count:
# the first entry whose bound holds. A program's latency is its N / BLOCK_Q steps, and the grid
# N / BLOCK_P programs, so narrow, long tiles: more programs, fewer steps. One H200, 48 sorts in
# a CUDA graph (tools/bench_moe_sort.py --tiles), us a sort at 256 / 1,024 / 2,048 / 8,192 pairs:
# 4x512 1.8 / 2.6 / 4.2 / 35.4, 8x1024 2.2 / 2.5 / 4.0 / 28.7, the former 32x128 3.3 / 9.1 /
# 16.8 / 67.4 (argsort 44-97).
TILES: tuple[tuple[int, tuple[int, int]], ...] = ((512, (4, 512)), (1 << 62, (8, 1024)))


def tile_for(n: int) -> tuple[int, int]:
    """``(block_p, block_q)`` for ``n`` pairs (``TILES``)."""
    return next(t for bound, t in TILES if n <= bound)


def _key(ids_ptr, idx, N, offset, num_keys):
    """int32 keys of pairs ``idx`` (past ``N``: ``num_keys + 1``, after every real key)."""
    key = tl.load(ids_ptr + idx, mask=idx < N, other=0).to(tl.int32) - offset
    key = tl.where((key >= 0) & (key < num_keys), key, num_keys)
    return tl.where(idx < N, key, num_keys + 1)


def _sort_keys_kernel(
    ids_ptr, order_ptr, back_ptr, counts_ptr, N, offset, num_keys, fill,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blocks = tl.cdiv(N, BLOCK_P)
    lanes = tl.arange(0, BLOCK_Q)
    if pid < blocks:
        p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
        kp = _key(ids_ptr, p, N, offset, num_keys)
        pos = tl.zeros([BLOCK_P], tl.int32)
        for start in range(0, N, BLOCK_Q):
            q = start + lanes
            kq = _key(ids_ptr, q, N, offset, num_keys)
            ahead = (kq[None, :] < kp[:, None]) | (
                (kq[None, :] == kp[:, None]) & (q[None, :] < p[:, None])
            )
            pos += tl.sum(ahead.to(tl.int32), axis=1)
        p_ok = p < N
        tl.store(order_ptr + pos, p.to(tl.int64), mask=p_ok)
        back = tl.where(kp < num_keys, pos.to(tl.int64), fill)
        tl.store(back_ptr + p, back, mask=p_ok)
    else:
        e = (pid - blocks) * BLOCK_P + tl.arange(0, BLOCK_P)  # BLOCK_P keys counted
        count = tl.zeros([BLOCK_P], tl.int32)
        for start in range(0, N, BLOCK_Q):
            kq = _key(ids_ptr, start + lanes, N, offset, num_keys)
            count += tl.sum((kq[None, :] == e[:, None]).to(tl.int32), axis=1)
        tl.store(counts_ptr + e, count.to(tl.int64), mask=e < num_keys)


if triton is not None:  # helpers are jitted at import, like _rounding.round_to
    _key = triton.jit(_key)


@functools.cache
def _build(interpret: bool):
    """The kernel for one run mode; ``interpret`` keys the cache only."""
    require_triton()
    return triton.jit(_sort_keys_kernel)


def sort_keys(
    ids: torch.Tensor, offset: int, num_keys: int, fill: int, tile: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids [N]`` int64 -> ``(order [N], back [N], counts [num_keys])`` int64: ``order`` lists
    the pairs by key (``ids - offset`` in ``[0, num_keys)``, else last), ties in index order;
    ``back[p]`` is pair p's position in it, or ``fill`` for a pair of no local key;
    ``counts[e]`` the pairs of key ``e``. ``tile``: ``(block_p, block_q)``, powers of two
    (None: :func:`tile_for`; ``tools/bench_moe_sort.py --tiles`` times them)."""
    require_triton()
    check_device("ids", ids)
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be a [N] int64 tensor, got {ids.dtype} {list(ids.shape)}")
    if num_keys < 1:
        raise ValueError(f"num_keys must be positive, got {num_keys}")
    n = ids.numel()
    block_p, block_q = tile_for(n) if tile is None else tile
    if min(block_p, block_q) < 1 or block_p & (block_p - 1) or block_q & (block_q - 1):
        raise ValueError(f"tile must be two powers of two, got {tile}")
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    back = torch.empty(n, dtype=torch.int64, device=ids.device)
    counts = torch.empty(num_keys, dtype=torch.int64, device=ids.device)
    grid = (triton.cdiv(n, block_p) + triton.cdiv(num_keys, block_p),)
    _build(interpret_mode())[grid](
        ids.contiguous(), order, back, counts, n, offset, num_keys, fill,
        BLOCK_P=block_p, BLOCK_Q=block_q, num_warps=NUM_WARPS,
    )  # fmt: skip
    return order, back, counts
