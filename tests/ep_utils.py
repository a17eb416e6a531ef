"""Helpers of the expert-parallel tests (run inside spawned gloo workers; no tests here)."""

from __future__ import annotations

import torch


def cpu_alltoall() -> None:
    """megatron-core's all-to-all dispatcher on a CUDA-less host (the reference of these tests):
    its split sizes copied to the host with ``tolist`` instead of its CUDA side stream."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as A2A

    if torch.cuda.is_available():
        return
    A2A.cuda_dtoh_stream = "cpu"  # built once per process; never used below

    def to_host(self, point, tokens_per_expert=None):
        if point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.tolist())
            if isinstance(self.num_out_tokens, torch.Tensor):
                self.num_out_tokens = int(self.num_out_tokens)
        return tokens_per_expert

    A2A._maybe_dtoh_and_synchronize = to_host


def switch_dispatch(chunks, choice: str) -> int:
    """Tests only: switch every expert-parallel MoE layer of ``chunks`` to ``choice`` (what
    ``LayerKernels.moe_dispatch`` sets when a model is built), to compare the dispatches on
    the same weights; returns how many layers were switched."""
    from megatron_grpo.megatron.moe.ep_dispatch import EPDispatch, choose_dispatch

    layers = [
        m
        for c in chunks
        for m in c.modules()
        if isinstance(getattr(m, "ep_dispatch", None), EPDispatch)
    ]
    for layer in layers:
        choose_dispatch(choice, True, layer.ep_dispatch.gathered_why)
        layer.ep_dispatch.choice = choice
    return len(layers)


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
