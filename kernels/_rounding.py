"""Rounding an fp32 value to the model dtype inside a kernel, round-to-nearest-even everywhere.

The decode kernels reproduce megatron-core's roundings of intermediates in the model dtype. On
GPU ``x.to(tl.bfloat16)`` rounds to nearest even, but Triton's CPU interpreter truncates, so
bf16 is rounded here on the bits (the result is an fp32 value that bf16 holds exactly); other
dtypes use the cast.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels' launchers raise a clear error on use
    triton = None
    tl = None


def _round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (nearest even), returned as fp32."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


round_to = triton.jit(_round_to) if triton is not None else None
