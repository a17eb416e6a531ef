"""The LM head's kernel seam: the torch reference (:mod:`.reference`) or the Triton kernels
(through :mod:`megatron_grpo.ops.kernels`), as one tuple of functions per implementation."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from megatron_grpo.ops.kernels import triton_kernels
from megatron_grpo.ops.lm_head import reference


class Kernels(NamedTuple):
    """The seam functions (see ``megatron_grpo.ops.lm_head.reference`` for the contract):
    softmax statistics and gradient of a logits chunk, the LM-head GEMM with those as
    epilogues, and the split (bf16 + int8 residual) d_weight accumulator of the single pass."""

    name: str
    logits_row_stats: Callable
    logits_grad: Callable
    head_gemm_stats: Callable
    head_gemm_grad: Callable
    split_acc_addmm: Callable
    split_acc_resolve: Callable


_NAMES = Kernels._fields[1:]
_TORCH = Kernels("torch", *(getattr(reference, n) for n in _NAMES))
_TRITON = Kernels("triton", *(getattr(triton_kernels, n) for n in _NAMES))


def kernels_named(name: str) -> Kernels:
    """The seam functions of a resolved implementation ("torch" or "triton")."""
    return _TORCH if name == "torch" else _TRITON
