"""Picks the implementation of the kernel seam: torch reference (ops/) or Triton (kernels/)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import NamedTuple

from megatron_grpo.ops import reference

IMPLS = ("auto", "torch", "triton")


class Kernels(NamedTuple):
    """The seam functions (see ``megatron_grpo.ops.reference`` for the contract): softmax
    statistics and gradient of a logits chunk, the LM-head GEMM with those as epilogues, and
    the split (bf16 + int8 residual) d_weight accumulator of the single pass."""

    name: str
    logits_row_stats: Callable
    logits_grad: Callable
    head_gemm_stats: Callable
    head_gemm_grad: Callable
    split_acc_addmm: Callable
    split_acc_resolve: Callable


_NAMES = Kernels._fields[1:]
_TORCH = Kernels("torch", *(getattr(reference, n) for n in _NAMES))


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_kernels() -> Kernels:
    mod = importlib.import_module("megatron_grpo.kernels")
    missing = [n for n in _NAMES if not hasattr(mod, n)]
    if missing:
        raise ImportError(f"impl='triton': megatron_grpo.kernels does not define {missing}")
    return Kernels("triton", *(getattr(mod, n) for n in _NAMES))


def triton_runs_on(device_type: str) -> bool:
    """Whether the Triton kernels run on ``device_type`` tensors: triton imports, and the
    tensors are on CUDA or Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return _triton_importable() and (device_type == "cuda" or interpreted)


def resolve_impl(impl: str, device_type: str) -> str:
    """The kernel implementation ``impl`` means on ``device_type`` tensors: "torch" or "triton".

    ``auto`` = triton on CUDA when triton imports, else torch. ``triton`` on CPU tensors only
    works under ``TRITON_INTERPRET=1``: anything else is an error rather than a silent switch to
    the torch path. (The decision of :func:`megatron_grpo.ops.plan.plan_lm_head`.)
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return "torch"
    if impl == "auto":
        return "triton" if device_type == "cuda" and _triton_importable() else "torch"
    if not _triton_importable():
        raise ImportError("impl='triton' needs the triton package")
    if not triton_runs_on(device_type):
        raise ValueError(
            f"impl='triton' on {device_type} tensors needs TRITON_INTERPRET=1 (or use impl='torch')"
        )
    return "triton"


def kernels_named(name: str) -> Kernels:
    """The seam functions of a resolved implementation ("torch" or "triton")."""
    return _TORCH if name == "torch" else _triton_kernels()
