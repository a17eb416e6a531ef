"""The KV cache at a fixed address (``rollout.engine.kv_cache_memory``): the decision, the
engine's mapping and unmapping around each call, and on GPU the driver's virtual memory.

Freed before each policy update and allocated again at the next rollout, a cache from the
caching allocator may land elsewhere, and every decode graph is then captured again (the MoE
twin at EP 2 TP 2 + SP on 2 H200: 4 re-captures in every steady step).
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import pytest
import torch

from megatron_grpo.rollout.engine.fixed_address import plan_kv_cache_memory
from tests.dist_utils import run_distributed


def test_plan_follows_the_graphs_and_names_the_field():
    cpu = torch.device("cpu")
    assert plan_kv_cache_memory("auto", cpu, graphs=False) == (False, "")
    assert plan_kv_cache_memory("allocator", cpu, graphs=True) == (False, "")
    # auto where graphs would want it but the device cannot: the allocator, and why
    assert plan_kv_cache_memory("auto", cpu, graphs=True) == (
        False,
        "allocator (needs a CUDA device)",
    )
    with pytest.raises(ValueError, match=r"rollout\.engine\.kv_cache_memory: fixed_address"):
        plan_kv_cache_memory("fixed_address", cpu, graphs=True)
    with pytest.raises(ValueError, match="did you mean 'fixed_address'"):
        plan_kv_cache_memory("fixed_adress", cpu, graphs=True)


def test_engine_options_reject_an_unknown_kv_cache_memory():
    from megatron_grpo.rollout import EngineOptions

    with pytest.raises(ValueError, match=r"rollout\.engine\.kv_cache_memory.*'allocator'"):
        EngineOptions(kv_cache_memory="alocator")


class HostMemory:
    """``FixedAddressMemory`` on the host: one buffer, every mapping at its start, and a mapping
    counted as viewed while a tensor over it lives (numpy views hold the buffer for torch)."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device, self.capacity = device, capacity
        self.base = np.zeros(capacity, dtype=np.uint8)
        self.address = self.base.ctypes.data
        self.maps = self.unmaps = 0
        self._owner: weakref.ref | None = None
        self._mapped = False

    def map(self, nbytes: int) -> torch.Tensor:
        if not self.unmap():
            raise RuntimeError("the fixed-address memory is still viewed by a tensor")
        owner = self.base[:nbytes]
        owner[:] = 0xFF  # contents undefined after a mapping: the cache must zero them
        self._owner, self._mapped = weakref.ref(owner), True
        self.maps += 1
        return torch.from_numpy(owner)

    def unmap(self) -> bool:
        if not self._mapped:
            return True
        if self._owner() is not None:
            return False
        self._mapped, self.unmaps = False, self.unmaps + 1
        return True


def _setup(samples: int, shortest: int, longest: int, max_new_tokens: int):
    """A tiny dense model (TP 1), greedy sampling and ``samples`` prompts of ``shortest`` to
    ``longest`` tokens."""
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import SamplingParams
    from tests.megatron_utils import build_layout, tiny_model

    cfg = tiny_model(init_method_std=0.3)
    model = unwrap(build_layout(ParallelConfig(), cfg)[0])
    params = SamplingParams(
        top_k=1, max_new_tokens=max_new_tokens, eos_id=3, vocab_size=cfg.vocab_size
    )
    g = torch.Generator().manual_seed(0)
    lens = [shortest + i % (longest - shortest + 1) for i in range(samples)]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    return cfg, model, params, prompts


def _engine_body(rank: int, world: int) -> None:
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, SamplingParams, generate

    cfg, model, params, prompts = _setup(9, 4, 8, max_new_tokens=10)
    options = EngineOptions(kv_cache_gib=0.01, context_bucket=8)
    gen = torch.Generator().manual_seed(1)
    want = generate(model, prompts, params, gen, engine=KVCacheEngine(model, options))

    # dropped after each call: mapped at the one address, unmapped when the call returns
    engine = KVCacheEngine(model, options)
    memory = engine.sizer.fixed = HostMemory(torch.device("cpu"), 1 << 24)
    for call in (1, 2):
        got = generate(model, prompts, params, torch.Generator().manual_seed(1), engine=engine)
        assert got == want  # the 0xFF left in the memory was zeroed
        assert (memory.maps, memory.unmaps) == (call, call)
    assert engine.cache is None

    # kept between calls: a longer call's new cache needs the kept one released first
    engine = KVCacheEngine(
        model, EngineOptions(kv_cache_gib=0.01, context_bucket=8, keep_cache=True)
    )
    memory = engine.sizer.fixed = HostMemory(torch.device("cpu"), 1 << 24)
    generate(model, prompts, params, torch.Generator().manual_seed(1), engine=engine)
    longer = SamplingParams(top_k=1, max_new_tokens=40, eos_id=3, vocab_size=cfg.vocab_size)
    generate(model, prompts, longer, torch.Generator().manual_seed(1), engine=engine)
    assert (memory.maps, memory.unmaps) == (2, 1)
    assert engine.cache.kv.data_ptr() == memory.address


def test_engine_maps_its_cache_per_call_and_releases_a_kept_one_first():
    run_distributed(_engine_body, 1)


def test_a_still_viewed_cache_moves_the_next_one_to_a_new_range():
    """An exception's frames may hold the cache after a call: the next cache cannot take the
    viewed range, so it takes a new one (with a warning) and the old one is unmapped later."""
    from megatron_grpo.rollout.engine.kv_cache import CacheSizer

    sizer = CacheSizer.__new__(CacheSizer)
    sizer.fixed, sizer._retired = HostMemory(torch.device("cpu"), 1 << 20), []
    first = sizer.fixed
    held = first.map(1024)[10:]  # a view outlives the call
    assert sizer.release() is False
    assert sizer.fixed is not first and sizer._retired == [first]
    assert first.unmaps == 0
    del held
    assert sizer.release() is True  # the retired range is unmapped once nothing views it
    assert sizer._retired == [] and first.unmaps == 1


# ---------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_fixed_address_memory_keeps_its_address_and_its_graphs():
    """1 GPU: map, unmap (the memory back to the driver), map again at the same address; a
    CUDA graph captured over the first mapping replays on the second."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from megatron_grpo.rollout.engine.fixed_address import FixedAddressMemory

    device = torch.device("cuda", torch.cuda.current_device())
    memory = FixedAddressMemory(device, 1 << 30)
    nbytes = 256 << 20
    t = memory.map(nbytes)
    assert t.device == device and t.data_ptr() == memory.address and t.numel() == nbytes
    x = t.view(torch.float32).zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1.0)
    graph.replay()
    assert x.sum().item() == x.numel()
    view = x[5:]
    del t, x
    assert memory.unmap() is False  # the view still reads it
    del view
    free = torch.cuda.mem_get_info(device)[0]
    assert memory.unmap() is True
    assert torch.cuda.mem_get_info(device)[0] - free >= nbytes  # back to the driver
    hog = torch.empty(nbytes, dtype=torch.uint8, device=device)  # takes whatever was freed
    again = memory.map(nbytes).view(torch.float32).zero_()
    assert again.data_ptr() == memory.address
    graph.replay()
    torch.cuda.synchronize()
    assert again.sum().item() == again.numel()
    with pytest.raises(ValueError, match="exceed the reserved"):
        memory.map(2 << 30)
    del again, hog, graph
    memory.close()
    assert memory.address == 0


def _gpu_engine_body(rank: int, world: int) -> None:
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate

    _, model, params, prompts = _setup(64, 6, 14, max_new_tokens=24)
    engine = KVCacheEngine(model, EngineOptions(context_bucket=16))  # auto, sized from memory
    assert engine.use_graphs and engine.sizer.fixed is not None, engine.sizer.memory
    assert engine.sizer.memory == "KV cache at a fixed address"
    first = generate(model, prompts, params, torch.Generator().manual_seed(1), engine=engine)
    captures, address = engine.graphs.captures, engine._static_key[2]
    assert captures > 1 and engine.sizer.fixed.mapped == 0  # unmapped after the call
    # the update's memory: what the allocator gives next lands where a freed cache was
    hogs = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = generate(model, prompts, params, torch.Generator().manual_seed(1), engine=engine)
    assert not [w for w in caught if "still referenced" in str(w.message)]
    assert again == first
    assert engine._static_key[2] == address
    assert engine.graphs.captures == captures, "graphs captured again: the cache moved"
    del hogs


@pytest.mark.gpu
def test_gpu_engine_captures_its_graphs_once_across_calls():
    """1 GPU: colocated use (the cache dropped after each call, memory allocated in between):
    the second call replays the first call's graphs with the same greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    run_distributed(_gpu_engine_body, 1, backend="nccl", timeout=120)
