"""The engine's memory between calls: its KV cache is unreferenced once a call returns and
returned to the driver (``rollout/memory_release.py``), and the optimizer state of the first
step lands in segments of its own (``train/optimizer_memory.py``): the ~20 GiB that stayed "in
use" from step 2 on (issue 42) and the smaller cache of partial rollouts (issue 41)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.rollout import memory_release
from megatron_grpo.train import optimizer_memory
from tests.dist_utils import run_distributed


def _count_empty_cache(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    return calls


def test_release_empties_the_cuda_cache_only_on_cuda(monkeypatch):
    calls = _count_empty_cache(monkeypatch)
    assert memory_release.release(torch.device("cpu")) is True and calls == []
    assert memory_release.release(torch.device("cuda", 0)) is True and calls == [1]


def test_release_collects_a_tensor_held_by_a_cycle(monkeypatch):
    _count_empty_cache(monkeypatch)
    gc.disable()
    try:
        holder = {"kv": torch.zeros(8)}
        holder["self"] = holder  # a cycle: only the collector frees it
        ref = weakref.ref(holder["kv"])
        del holder
        assert ref() is not None
        assert memory_release.release(torch.device("cpu"), ref) is True and ref() is None
        kept = torch.zeros(4)
        assert memory_release.release(torch.device("cpu"), weakref.ref(kept)) is False
    finally:
        gc.enable()


def _fake_optimizer(is_cuda: bool, state: dict) -> SimpleNamespace:
    inner = SimpleNamespace(
        state=state, param_groups=[{"params": [SimpleNamespace(is_cuda=is_cuda)]}]
    )
    return SimpleNamespace(optimizer=inner)


def test_first_step_releases_the_cache_once_on_gpu(monkeypatch):
    calls = _count_empty_cache(monkeypatch)
    assert optimizer_memory.release_before_first_step(_fake_optimizer(True, {})) is True
    assert calls == [1]
    with_state = _fake_optimizer(True, {"p": {"exp_avg": torch.zeros(1)}})
    assert optimizer_memory.release_before_first_step(with_state) is False
    assert optimizer_memory.release_before_first_step(_fake_optimizer(False, {})) is False
    chained = SimpleNamespace(chained_optimizers=[_fake_optimizer(True, {}), SimpleNamespace()])
    assert optimizer_memory.release_before_first_step(chained) is True
    assert calls == [1, 1]


def _engine_body(rank: int, world: int) -> None:
    """Every KV cache an engine allocates is unreferenced when generate / run_requests return
    (also with kept rows, ``keep_kv``), and each call releases memory before sizing and after."""
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, SamplingParams
    from megatron_grpo.rollout import kv_cache as kvc
    from megatron_grpo.rollout.engine import memory_release as engine_release
    from megatron_grpo.rollout.requests import Request
    from tests.megatron_utils import build_layout, tiny_model

    model = unwrap(build_layout(ParallelConfig(), tiny_model(init_method_std=0.3))[0])
    made: list[weakref.ref] = []
    real_init = kvc.KVCache.__init__

    def recording_init(self, *args, **kw):
        real_init(self, *args, **kw)
        made.append(weakref.ref(self.kv))

    released: list[bool] = []
    real_release = engine_release.release

    def recording_release(device, dropped=None):
        gone = real_release(device, dropped)
        released.append(dropped is not None and gone)
        return gone

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvc.KVCache, "__init__", recording_init)
        mp.setattr(engine_release, "release", recording_release)
        params = SamplingParams(temperature=1.0, max_new_tokens=6, eos_id=3, vocab_size=100)
        engine = KVCacheEngine(model, EngineOptions(context_bucket=16, kv_cache_gib=None))
        g = torch.Generator().manual_seed(0)
        engine.generate([[5, 6, 7], [8, 9]], params, g)
        assert engine.cache is None and len(made) == 1 and made[0]() is None
        assert released == [False, True]  # before sizing; the dropped cache, gone
        reqs = [Request([5, 6, 7], torch.rand(6)), Request([8, 9, 10, 11], torch.rand(6))]
        engine.run_requests(reqs, params, 0, stop=lambda finished: True, keep_kv=True)
        assert len(made) == 2 and made[1]() is None and released[-1] is True
        assert all(r.kv is None or r.kv.device.type == "cpu" for r in reqs)


@pytest.mark.slow
def test_the_engine_keeps_no_reference_to_its_cache():
    run_distributed(_engine_body, 1)
