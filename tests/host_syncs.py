"""Counting host syncs in tests: on CUDA with torch's sync debug mode (:func:`cuda_host_syncs`),
on CPU with a probe of the Python-level calls that would sync (:class:`HostSyncProbe`)."""

from __future__ import annotations

import warnings

import torch


def cuda_host_syncs(fn) -> list[str]:
    """The synchronizing CUDA calls ``fn()`` makes (torch's sync debug mode warns once per
    call), as the ``file:line`` that made each."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]


# Tensor methods and torch functions that wait for the device on CUDA (a value to the host, or
# an output whose shape depends on the data).
HOST_SYNCS = frozenset(
    ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
     "masked_select", "unique", "unique_consecutive", "argwhere", "bincount", "equal", "allclose")
)  # fmt: skip


class HostSyncProbe(torch.overrides.TorchFunctionMode):
    """Records calls that would sync a CUDA device with the host, by name with the caller's
    frame (runs on CPU: Python-level syncs only, not a kernel's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import traceback

        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        data_shaped = name == "repeat_interleave" and "output_size" not in kwargs
        if name in HOST_SYNCS or data_shaped or (name == "where" and len(args) == 1):
            frame = traceback.extract_stack()[-2]
            self.calls.append(f"{name} at {frame.filename}:{frame.lineno}")
        return func(*args, **kwargs)
