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


def check_graphs_match_eager(model, prompts: list[list[int]]) -> None:
    """The engine captures ``model``'s decode steps in CUDA graphs and (greedy, bf16) samples
    what eager decode samples, but for up to 2 responses that a near-tie may flip."""
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate
    from megatron_grpo.rollout.engine.params import SamplingParams

    params = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=10, eos_id=3, vocab_size=100)
    graphed = KVCacheEngine(model, EngineOptions(kv_cache_gib=1.0, context_bucket=16))
    assert graphed.use_graphs and not graphed.graphs_off, graphed.graphs_off
    got = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=graphed)
    assert graphed.graphs.captures > 0
    options = EngineOptions(kv_cache_gib=1.0, context_bucket=16, cuda_graphs=False)
    eager = KVCacheEngine(model, options)
    want = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=eager)
    same = sum(a == b for a, b in zip(got.responses, want.responses, strict=True))
    assert same >= len(prompts) - 2, f"{same} of {len(prompts)} greedy responses agree"
