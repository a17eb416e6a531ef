"""``mm_f32``: a GEMM of low-precision operands accumulated and returned in fp32."""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor


@cache
def _has_out_dtype_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` runs for ``dtype`` inputs on this device."""
    try:
        a = torch.zeros(2, 2, dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def mm_f32(a: Tensor, b: Tensor, acc: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """``a @ b`` accumulated and returned in fp32: ``acc += a @ b`` in place when ``acc`` is
    given, else written into ``out`` (a contiguous fp32 tensor) or a new tensor.

    Low-precision operands use the out_dtype GEMM (fp32 accumulator written out as fp32) where
    torch provides it, else they are upcast (exact products, more memory: CPU and old torch).
    """
    f32 = torch.float32
    if not (a.dtype == f32 and b.dtype == f32):
        if a.dtype == b.dtype and _has_out_dtype_mm(a.device.type, a.dtype):
            if acc is not None:
                return torch.addmm(acc, a, b, out_dtype=f32, out=acc)
            if out is not None:
                return torch.mm(a, b, out_dtype=f32, out=out)
            return torch.mm(a, b, out_dtype=f32)
        a, b = a.float(), b.float()
    if acc is not None:
        return acc.addmm_(a, b)
    return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
