"""Launcher plumbing shared by the kernels: Triton availability, run modes, input checks.

The kernel modules import Triton optionally, so ``import megatron_grpo.kernels`` works on
machines without it; using a kernel there raises a clear :class:`RuntimeError`.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

AUTOTUNE_ENV = "MEGATRON_GRPO_AUTOTUNE"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def require_triton() -> ModuleType:
    """Import and return ``triton``, or raise a RuntimeError saying what to do instead."""
    try:
        import triton
    except ImportError as e:
        raise RuntimeError(
            "megatron_grpo.kernels needs the `triton` package (pip install triton); "
            "without it use impl='torch'"
        ) from e
    return triton


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Triton decides per ``triton.jit`` decoration, and its own library (``tl.max``, ``tl.sum``)
    is decorated when triton is first imported: the variable must be set before that import.
    The kernels here are built per mode at call time (see the ``_build`` functions).
    """
    triton = require_triton()
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # triton >= 3.4
        on = bool(knobs.runtime.interpret)
    else:
        on = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if on and type(triton.language.zeros).__name__ == "JITFunction":
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported, so Triton's own library was "
            "built for the GPU: set it before the first import of triton (megatron.core and "
            "transformers import triton)"
        )
    return on


def autotune_enabled() -> bool:
    """Autotune only on request (MEGATRON_GRPO_AUTOTUNE=1); else the fixed default config."""
    return os.environ.get(AUTOTUNE_ENV, "0") == "1"


def check_logits(name: str, logits: torch.Tensor) -> None:
    """A [C, V_local] float tensor whose last dimension is contiguous."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{name} must be a 2-D [C, V_local] tensor, got {got}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.size(1) > 1 and logits.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along the vocab dimension (stride(1) == 1)")


def check_device(name: str, t: torch.Tensor) -> None:
    """CUDA, or any device under Triton's interpreter."""
    if t.device.type != "cuda" and not interpret_mode():
        raise ValueError(
            f"{name} is on {t.device}: the Triton kernels need CUDA tensors (or Triton's CPU "
            "interpreter: TRITON_INTERPRET=1 set before triton is first imported)"
        )


def check_row_vector(name: str, t: torch.Tensor, rows: int, dtype: torch.dtype, device) -> None:
    """A contiguous [rows] tensor of `dtype` on `device`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.shape != (rows,):
        raise ValueError(f"{name} must have shape [C]=[{rows}], got {list(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the logits")
    if rows > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def check_scalars(n_valid: int, v_local: int, inv_temperature: float) -> None:
    if isinstance(n_valid, bool) or not isinstance(n_valid, int):
        raise ValueError(f"n_valid must be an int, got {type(n_valid).__name__}")
    if not 0 <= n_valid <= v_local:
        raise ValueError(f"n_valid must be in [0, V_local={v_local}], got {n_valid}")
    inv_t = float(inv_temperature)
    if not (inv_t > 0.0 and inv_t < float("inf")):
        raise ValueError(f"inv_temperature must be finite and > 0, got {inv_temperature}")


KERNEL_KINDS = ("tma", "pointer")


def num_sms(device: torch.device) -> int:
    """Programs of a persistent kernel: the device's SMs (4 under the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_aligned(x: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``x``: its start and row stride are 16-byte
    aligned."""
    return x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0


def tma_kind(tensors: tuple[torch.Tensor, ...], kernel: str | None) -> str:
    """Which of a GEMM's two kernels runs (:data:`KERNEL_KINDS`): ``kernel`` when given, else
    "tma" (persistent, TMA loads) on Hopper and newer GPUs when the rows of every tensor of
    ``tensors`` are 16-byte aligned, else "pointer"."""
    if kernel is not None:
        if kernel not in KERNEL_KINDS:
            raise ValueError(f"kernel must be one of {KERNEL_KINDS} or None, got {kernel!r}")
        return kernel
    dev = tensors[0].device
    if interpret_mode() or dev.type != "cuda":
        return "pointer"
    aligned = all(tma_aligned(x) for x in tensors)
    return "tma" if aligned and torch.cuda.get_device_capability(dev)[0] >= 9 else "pointer"
