"""Grouped GEMM of the MoE experts: consecutive row groups of ``x``, each times its own weight.

``x [M, K]`` rows sorted by group, ``weight [G, N, K]`` (``nn.Linear`` layout per group) and
``ends [G]`` int32 cumulative row counts (groups may be empty) give ``y [M, N]`` with
``y[rows of g] = x[rows of g] @ weight[g].T``, in ``x``'s dtype, accumulated in fp32 (bf16 /
fp16) as one GEMM per expert would. Rows past ``ends[-1]`` (a buffer of fixed size holding
fewer routed rows) belong to no group: they cost nothing and their output is unspecified
(torch's grouped GEMM leaves them unwritten; the padded path writes zeros).

Implementations (:data:`GROUPED_MM_IMPLS`; :func:`resolve_grouped_mm` is the one decision):

* ``"grouped_mm"``: torch's grouped GEMM (``torch.nn.functional.grouped_mm``, before torch 2.11
  ``torch._grouped_mm``) and its backward: bf16 on CUDA (CUTLASS on Hopper), fp32 / bf16 /
  fp16 on CPU (torch >= 2.9). Its kernels read rows with 16-byte aligned strides, so ``K`` and
  ``N`` times the element size must be multiples of 16; group sizes are free.
* ``"padded_bmm"``: the reference, for any dtype, device and shape: the rows are scattered into
  ``[G, C, K]`` (``C`` the largest group, one host sync), one ``bmm``, gathered back. No loop
  over the groups; it computes ``G * C`` rows, so it is slow for uneven loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_grpo.ops.kernels import CHOICES, check_choice

GROUPED_MM_IMPLS = CHOICES["grouped_gemm"]

_TORCH_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# dtypes torch's grouped GEMM takes, by device type (CPU kernel since torch 2.9)
_NATIVE_DTYPES = {
    "cuda": (torch.bfloat16,),
    "cpu": (torch.float32, torch.bfloat16, torch.float16) if _TORCH_VERSION >= (2, 9) else (),
}


def grouped_mm_supports(x: Tensor, weight: Tensor) -> str | None:
    """Why torch's grouped GEMM cannot take ``x [M, K]`` x ``weight [G, N, K]``, or None."""
    if _TORCH_GROUPED_MM is None:
        return f"torch {torch.__version__} has no grouped_mm"
    if x.dtype not in _NATIVE_DTYPES.get(x.device.type, ()):
        return f"torch's grouped_mm does not take {x.dtype} on {x.device.type}"
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return "torch's grouped_mm needs a Hopper-class GPU (sm90+) for bf16"
    align = 16 // x.element_size()
    if x.size(1) % align or weight.size(1) % align:
        return f"grouped_mm needs K={x.size(1)} and N={weight.size(1)} multiples of {align}"
    return None


def resolve_grouped_mm(impl: str, x: Tensor, weight: Tensor) -> str:
    """The implementation ``impl`` means for these operands: "grouped_mm" or "padded_bmm".

    ``auto`` = torch's grouped GEMM wherever it takes the operands, else the padded bmm.
    An explicit ``grouped_mm`` it cannot take is an error naming why, never a silent switch."""
    check_choice("grouped_gemm", impl, "grouped mm impl")
    if impl == "padded_bmm":
        return impl
    why = grouped_mm_supports(x, weight)
    if why is None:
        return "grouped_mm"
    if impl == "grouped_mm":
        raise ValueError(f"grouped mm impl 'grouped_mm': {why} (use 'auto' or 'padded_bmm')")
    return "padded_bmm"


def grouped_mm_padded(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """Reference: ``x [M, K]``, ``weight [G, N, K]``, ``ends [G]`` -> ``[M, N]`` via one bmm."""
    g, m = weight.size(0), x.size(0)
    ends = ends.to(device=x.device, dtype=torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    rows = torch.arange(m, device=x.device)
    group = torch.searchsorted(ends, rows, right=True)  # [M] group of each row
    slot = rows - (ends - counts)[group.clamp(max=g - 1)]  # position within its group
    cap = int(counts.max()) if g else 0  # the one host sync
    # rows past ends[-1] (a fixed-size buffer, moe.ep_dispatch) compute nothing: zero rows
    keep = group < g
    group, slot = group.clamp(max=max(g - 1, 0)), torch.where(keep, slot, 0)
    padded = x.new_zeros(g, max(cap, 1), x.size(1))
    padded = padded.index_put((group, slot), torch.where(keep[:, None], x, 0), accumulate=True)
    out = torch.bmm(padded, weight.transpose(1, 2))  # [G, C, N]
    return torch.where(keep[:, None], out[group, slot], 0)


def grouped_mm(x: Tensor, weight: Tensor, ends: Tensor, *, impl: str = "auto") -> Tensor:
    """``x [M, K]`` (rows sorted by group) times ``weight [G, N, K]`` per group, ``ends [G]``
    the cumulative group sizes (int, on any device; ``ends[-1] <= M``) -> ``[M, N]``."""
    if x.dim() != 2 or weight.dim() != 3 or x.size(1) != weight.size(2):
        raise ValueError(
            f"grouped_mm: x must be [M, K] and weight [G, N, K], got {list(x.shape)} and "
            f"{list(weight.shape)}"
        )
    if ends.shape != (weight.size(0),):
        raise ValueError(f"grouped_mm: ends must be [G={weight.size(0)}], got {list(ends.shape)}")
    # no rows (an EP rank without tokens): the padded path keeps weight in the graph (zero grad)
    if resolve_grouped_mm(impl, x, weight) == "padded_bmm" or x.size(0) == 0:
        return grouped_mm_padded(x, weight, ends)
    offs = ends.to(device=x.device, dtype=torch.int32, non_blocking=True)
    return _TORCH_GROUPED_MM(x.contiguous(), weight.transpose(1, 2), offs=offs)
