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
