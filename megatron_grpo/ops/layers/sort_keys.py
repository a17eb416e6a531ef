"""MoE (token, slot) pairs sorted by local expert, without a host sync: the dispatches' routing.

``sort_keys(ids, offset, num_keys, fill)``: pair ``p``'s key is ``ids[p] - offset`` where that is
in ``[0, num_keys)`` (a local expert), else ``num_keys`` (sorted last). Returns ``order [N]``
(the pairs by key, ties in index order: megatron-core's permuted layout), ``back [N]`` (each
pair's position in ``order``, ``fill`` for a pair of no local key) and ``counts [num_keys]``.

Two implementations, one decision (:func:`resolve_moe_sort`, ``LayerKernels.moe_sort``):

* "argsort" (:func:`sort_keys_torch`, the reference): ``torch.argsort(stable=True)``, the
  inverse by a scatter, the counts by a ``scatter_add``: ~8 launches, ~50 us in a CUDA graph
  on an H200 for up to 4,096 pairs (the radix sort alone ~29 us).
* "counting" (``kernels.sort_keys``): all three in one Triton launch, ``O(N^2)`` comparisons,
  so "auto" takes it on CUDA up to :data:`COUNTING_SORT_MAX_PAIRS` pairs, where it was
  measured ahead (decode steps), and the argsort above (training and prefill batches).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.ops.kernels import check_choice, triton_kernels, triton_runs_on

# kernels.sort_keys compares every pair with every other, so the radix sort wins beyond a size:
# on an H200 (tools/bench_moe_sort.py, in CUDA graphs) 16.9 vs 53.2 us at 2,048 pairs, 68 vs 100
# at 8,192, 171 vs 104 at 16,384
COUNTING_SORT_MAX_PAIRS = 8192


def resolve_moe_sort(choice: str, pairs: int, device_type: str) -> str:
    """What ``choice`` (``CHOICES["moe_sort"]``) means for ``pairs`` pairs on ``device_type``:
    "argsort" or "counting". An explicit "counting" where Triton cannot run is an error."""
    check_choice("moe_sort", choice)
    if choice == "counting" and not triton_runs_on(device_type):
        raise ValueError(
            f"moe_sort='counting' on {device_type} tensors needs Triton on CUDA (or "
            "TRITON_INTERPRET=1); use 'auto' or 'argsort'"
        )
    if choice == "auto":
        fits = pairs <= COUNTING_SORT_MAX_PAIRS
        return (
            "counting" if device_type == "cuda" and fits and triton_runs_on("cuda") else "argsort"
        )
    return choice


def sort_keys_torch(ids: Tensor, offset: int, num_keys: int, fill: int) -> tuple[Tensor, ...]:
    """The reference of :func:`sort_keys` (module docstring)."""
    key = ids - offset
    local = (key >= 0) & (key < num_keys)
    key = torch.where(local, key, num_keys)
    order = torch.argsort(key, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    back = torch.where(local, pos, fill)
    counts = torch.zeros(num_keys + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return order, back, counts[:num_keys]


def sort_keys(
    ids: Tensor, offset: int, num_keys: int, fill: int, choice: str = "auto"
) -> tuple[Tensor, Tensor, Tensor]:
    """``ids [N]`` int64 expert ids -> ``(order [N], back [N], counts [num_keys])`` int64
    (module docstring); ``choice``: ``CHOICES["moe_sort"]``."""
    flat = ids.reshape(-1).long()
    if resolve_moe_sort(choice, flat.numel(), flat.device.type) == "counting":
        return triton_kernels.sort_keys(flat, offset, num_keys, fill)
    return sort_keys_torch(flat, offset, num_keys, fill)
