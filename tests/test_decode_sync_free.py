"""The engine's decode step calls nothing that waits for the device, so it can be captured in
a CUDA graph: at EP 2 (MoE, the gathered dispatch) and at TP 2 (dense, vocab-parallel
sampling). A CPU probe of Python-level syncs (``tests/host_syncs.HostSyncProbe``); the GPU tests
capture the real graphs."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def _body(rank: int, world: int, layout: str) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate
    from megatron_grpo.rollout.engine import kv_engine
    from megatron_grpo.rollout.engine.params import SamplingParams
    from tests.ep_utils import cpu_alltoall
    from tests.host_syncs import HostSyncProbe
    from tests.megatron_utils import VOCAB, build_layout, tiny_model
    from tests.test_ep_dispatch import _cfg

    cpu_alltoall()
    if layout == "ep2":
        chunks = build_layout(ParallelConfig(expert_model_parallel_size=2), _cfg(2, num_layers=2))
    else:
        chunks = build_layout(ParallelConfig(tensor_model_parallel_size=2), tiny_model())
    model = unwrap(chunks[0])
    engine = KVCacheEngine(model, EngineOptions(kv_cache_gib=0.01, context_bucket=16))
    probe, steps = HostSyncProbe(), []
    real = kv_engine.KVCacheEngine._step

    def probed(self, *args, **kwargs):
        steps.append(1)
        with probe:
            real(self, *args, **kwargs)

    kv_engine.KVCacheEngine._step = probed
    try:
        params = SamplingParams(max_new_tokens=6, eos_id=3, vocab_size=VOCAB)
        # EP ranks bring their own prompts; TP ranks generate the same ones
        own = rank if layout == "ep2" else 0
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]][: 2 + own]
        generate(model, prompts, params, torch.Generator().manual_seed(own), engine=engine)
    finally:
        kv_engine.KVCacheEngine._step = real
    assert steps, "no decode step ran"
    assert not probe.calls, probe.calls


@pytest.mark.parametrize("layout", ["ep2", "tp2"])
def test_decode_step_makes_no_host_sync(layout):
    run_distributed(_body, 2, layout)
