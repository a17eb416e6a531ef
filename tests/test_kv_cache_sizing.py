"""How the KV cache is sized: ``kv_cache_gib`` as set (or 16 GiB on CPU), else from the GPU's
memory (``kv_cache_fraction`` of the total in use at most, after the call's headroom), never
more slots than samples, the same count on every rank of a TP group, and the settings checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_grpo.rollout.engine.kv_cache import Headroom, memory_slots, require_slots
from tests.dist_utils import run_distributed

GIB, MIB = 2**30, 2**20
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_memory_slots_formula():
    """``(fraction * total - (total - free) - fixed) // (per_seq + per_slot)``."""
    room = Headroom(fixed=2 * GIB, per_slot=4 * MIB)
    # 80 GiB GPU, 20 GiB in use: 0.9 * 80 - 20 - 2 = 50 GiB for slots of 100 + 4 MiB
    assert memory_slots(60 * GIB, 80 * GIB, 100 * MIB, 0.9, room) == 50 * 1024 // 104
    assert memory_slots(60 * GIB, 80 * GIB, 100 * MIB, 1.0, room) == 58 * 1024 // 104
    assert memory_slots(60 * GIB, 80 * GIB, 100 * MIB, 0.5, room) == 18 * 1024 // 104
    # more in use (or a bigger headroom): fewer slots; nothing left: 0, never negative
    assert memory_slots(40 * GIB, 80 * GIB, 100 * MIB, 0.9, room) == 30 * 1024 // 104
    assert memory_slots(60 * GIB, 80 * GIB, 100 * MIB, 0.9, Headroom(0, 0)) == 52 * 1024 // 100
    assert memory_slots(10 * GIB, 80 * GIB, 100 * MIB, 0.9, room) == 0


def test_too_little_memory_is_an_error_naming_the_settings():
    room = Headroom(fixed=GIB, per_slot=MIB)
    free, total, per_seq = 9 * GIB, 80 * GIB, 100 * MIB
    assert memory_slots(free, total, per_seq, 0.9, room) == 0
    with pytest.raises(
        ValueError, match=r"rollout\.engine\.kv_cache_fraction=0\.9 leaves no room"
    ) as e:
        require_slots(0, free, total, per_seq, 0.9, room)
    assert "rollout.engine.kv_cache_gib" in str(e.value) and "71.00 GiB in use" in str(e.value)
    assert require_slots(3, free, total, per_seq, 0.9, room) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kv_cache_gib=0.0), "kv_cache_gib must be > 0"),
        (dict(kv_cache_gib=-1.0), "kv_cache_gib must be > 0"),
        (dict(kv_cache_fraction=0.0), r"kv_cache_fraction must be in \(0, 1\], got 0.0"),
        (dict(kv_cache_fraction=1.5), r"kv_cache_fraction must be in \(0, 1\], got 1.5"),
    ],
)
def test_engine_options_validation_names_the_field(kwargs, message):
    from megatron_grpo.rollout import EngineOptions

    with pytest.raises(ValueError, match=message):
        EngineOptions(**kwargs)


def test_engine_options_defaults():
    from megatron_grpo.rollout import EngineOptions

    o = EngineOptions()
    assert (o.kv_cache_gib, o.kv_cache_fraction) == (None, 0.9)
    assert EngineOptions(kv_cache_gib=2.5, kv_cache_fraction=1.0).kv_cache_gib == 2.5


def test_rollout_config_fields_and_validation():
    from megatron_grpo.config import ConfigError
    from megatron_grpo.train.config import load_train_config

    recipe = RECIPES / "tiny.yaml"
    e = load_train_config(recipe).rollout.engine
    assert (e.kv_cache_gib, e.kv_cache_fraction) == (None, 0.9)
    sets = ["rollout.engine.kv_cache_gib=3", "rollout.engine.kv_cache_fraction=0.5"]
    e = load_train_config(recipe, sets).rollout.engine
    assert (e.kv_cache_gib, e.kv_cache_fraction) == (3.0, 0.5)
    assert load_train_config(RECIPES / "tiny_long.yaml").rollout.engine.kv_cache_gib == 1.0
    fraction = r"rollout.engine.kv_cache_fraction must be in \(0, 1\]"
    for override, message in [
        ("rollout.engine.kv_cache_fraction=0", fraction),
        ("rollout.engine.kv_cache_fraction=1.01", fraction),
        ("rollout.engine.kv_cache_gib=0", "rollout.engine.kv_cache_gib must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_train_config(recipe, [override])


def test_headroom_from_the_shapes():
    """Per slot: the fp32 logits and sampling buffers of the vocabulary (x2 with CUDA graphs);
    fixed: the scratch slot, RoPE and one prefill forward's activations."""
    from types import SimpleNamespace

    from megatron_grpo.rollout.engine import kv_cache as kvc

    cfg = SimpleNamespace(
        hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, gated_linear_unit=True, num_moe_experts=None,
        tensor_model_parallel_size=1,
    )  # fmt: skip
    width = kvc.activation_width(cfg, 1)
    assert width == 4 * 64 + 3 * (4 + 4) * 16 + 2 * 2 * 128
    out = torch.nn.Linear(64, 104)  # [V_local, H]
    model = SimpleNamespace(config=cfg, share_embeddings_and_output_weights=False, output_layer=out)
    shape = kvc.CacheShape(layers=2, kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    eager = Headroom.of(model, shape, seq_len=64, prefill_tokens=100, graphs=False)
    graphs = Headroom.of(model, shape, seq_len=64, prefill_tokens=100, graphs=True)
    assert eager.per_slot == 4 * (104 + 6 * 104) + 2 * width + 64
    assert graphs.per_slot - 64 == 2 * (eager.per_slot - 64)
    assert eager.fixed == shape.bytes_per_token * 64 + 64 * 16 * 16 + 100 * width * 2
    more = Headroom.of(model, shape, seq_len=64, prefill_tokens=200, graphs=False)
    assert more.fixed - eager.fixed == 100 * width * 2


# ------------------------------------------------------------------ the engine (CPU, gloo)
def _engine_setup(parallel, **kw):
    from megatron_grpo.megatron import unwrap
    from tests.megatron_utils import build_layout, tiny_model

    cfg = tiny_model(init_method_std=0.3, **kw)
    return unwrap(build_layout(parallel, cfg)[0])


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 14, (n,), generator=g).tolist()
    return [torch.randint(0, 100, (k,), generator=g).tolist() for k in lens]


def _params():
    from megatron_grpo.rollout import SamplingParams

    return SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, eos_id=3, vocab_size=100,
                          top_k=1)  # fmt: skip


def _fake_memory(monkeypatch, free: int, total: int) -> None:
    from megatron_grpo.rollout.engine import kv_cache as kvc

    monkeypatch.setattr(kvc, "device_memory", lambda device, cached=True: (free, total))


def _single_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate
    from megatron_grpo.rollout.engine import kv_cache as kvc

    model = _engine_setup(ParallelConfig())
    prompts, params = _prompts(12), _params()
    per_seq = 2 * 2 * 2 * 16 * 32 * 4  # layers * (k, v) * kv heads * head dim * 32 tokens * fp32

    def run(options):
        engine = KVCacheEngine(model, options)
        out = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)
        return engine, out

    # CPU, nothing set: the fixed 16 GiB default, so every sample has a slot (as before).
    engine, want = run(EngineOptions(context_bucket=32))
    assert engine.stats["slots"] == 12
    assert engine.stats["kv_cache_gib"] == 13 * per_seq / GIB  # + the scratch slot
    # An explicit budget: exactly min(samples, budget / bytes per sequence).
    engine, got = run(EngineOptions(kv_cache_gib=5 * per_seq / GIB, context_bucket=32))
    assert engine.stats["slots"] == 5 and got.responses == want.responses
    # Sized from (faked) device memory: the formula's count, streamed, same tokens ...
    with pytest.MonkeyPatch.context() as mp:
        options = EngineOptions(context_bucket=32, kv_cache_fraction=0.5)
        room = kvc.Headroom.of(model, kvc.CacheShape.of(model), 32, sum(map(len, prompts)), False)
        total = 64 * GIB
        free = total // 2 + room.fixed + 4 * (per_seq + room.per_slot) + 100  # room for 4
        _fake_memory(mp, free, total)
        engine, got = run(options)
        assert engine.stats["slots"] == 4 and got.responses == want.responses
        # ... never more slots than samples ...
        _fake_memory(mp, total, total)
        engine, got = run(options)
        assert engine.stats["slots"] == 12 and got.responses == want.responses
        # ... and no room for one sequence is an error naming the setting.
        _fake_memory(mp, total // 2, total)
        with pytest.raises(
            ValueError, match=r"rollout\.engine\.kv_cache_fraction=0\.5 leaves no room"
        ):
            run(options)
        # A kept cache counts as free (it is dropped before a new one is allocated): the next
        # call, whose free memory is less by the kept cache, finds room for 4 again and keeps it.
        options = EngineOptions(context_bucket=32, kv_cache_fraction=0.5, keep_cache=True)
        _fake_memory(mp, free, total)
        engine, _ = run(options)
        kept = engine.cache
        assert engine.stats["slots"] == 4 and kept is not None
        _fake_memory(mp, free - 5 * per_seq, total)  # 4 slots + the scratch slot
        generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)
        assert engine.stats["slots"] == 4 and engine.cache is kept


@pytest.mark.slow
def test_engine_sizes_the_cache_cpu():
    run_distributed(_single_body, 1)


def _tp_body(rank: int, world: int) -> None:
    """TP ranks with different free memory agree on the smallest slot count."""
    import torch.distributed as dist

    from megatron_grpo.megatron import ParallelConfig
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate
    from megatron_grpo.rollout.engine import kv_cache as kvc
    from megatron_grpo.rollout.engine.kv_cache import _agree_min

    assert _agree_min(10 + rank, [dist.group.WORLD]) == 10
    assert _agree_min(7, []) == 7
    model = _engine_setup(ParallelConfig(tensor_model_parallel_size=world))
    prompts, params = _prompts(12, seed=1), _params()
    per_seq = 2 * 2 * 1 * 16 * 32 * 4  # one KV head per TP rank
    room = kvc.Headroom.of(model, kvc.CacheShape.of(model), 32, sum(map(len, prompts)), False)
    total = 64 * GIB
    fits = 3 + 2 * rank  # rank 0: room for 3 sequences, rank 1: for 5
    with pytest.MonkeyPatch.context() as mp:
        _fake_memory(mp, total // 2 + room.fixed + fits * (per_seq + room.per_slot), total)
        engine = KVCacheEngine(model, EngineOptions(context_bucket=32, kv_cache_fraction=0.5))
        out = generate(model, prompts, params, torch.Generator().manual_seed(3), engine=engine)
    assert engine.stats["slots"] == 3
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    assert gathered[0] == gathered[1]


@pytest.mark.slow
def test_tp_ranks_agree_on_the_slot_count():
    run_distributed(_tp_body, 2)


# ------------------------------------------------------------------ GPU
def _gpu_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, generate
    from megatron_grpo.rollout.engine import kv_cache as kvc

    model = _engine_setup(ParallelConfig())  # fp32: streamed and batched tokens are equal
    prompts, params = _prompts(40, seed=2), _params()
    engine = KVCacheEngine(model, EngineOptions(context_bucket=16))  # auto, CUDA graphs
    got = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=engine)
    assert engine.stats["slots"] == 40  # a tiny model: every sample fits
    free, total = kvc.device_memory(torch.device("cuda"))
    shape = kvc.CacheShape.of(model)
    room = kvc.Headroom.of(model, shape, 32, sum(map(len, prompts)), True)
    per_seq = shape.bytes_per_token * 32
    assert memory_slots(free, total, per_seq, 0.9, room) > 40
    assert torch.cuda.max_memory_allocated() < 0.9 * total
    # A budget of 7 slots (faked free memory): streamed, same tokens.
    with pytest.MonkeyPatch.context() as mp:
        fake = total - int(0.9 * total) + room.fixed + 7 * (per_seq + room.per_slot) + 8
        _fake_memory(mp, fake, total)
        small = KVCacheEngine(model, EngineOptions(context_bucket=16))
        again = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=small)
        assert small.stats["slots"] == 7 and again.responses == got.responses
    # The allocator cannot place the cache in one piece: sized again from the driver's free
    # memory, after returning the cached segments.
    calls = []
    real = kvc.KVCache

    def flaky(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 1:
            raise torch.OutOfMemoryError("fragmented")
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvc, "KVCache", flaky)
        retry = KVCacheEngine(model, EngineOptions(context_bucket=16))
        again = generate(model, prompts, params, torch.Generator().manual_seed(5), engine=retry)
    assert len(calls) == 2 and again.responses == got.responses


@pytest.mark.gpu
def test_gpu_auto_sized_cache():
    run_distributed(_gpu_body, 1, backend="nccl")


def test_the_cache_line_repeats_only_when_memory_shrinks_it(capsys):
    """An evaluation's smaller batch gets fewer slots without a second KV-cache line; fewer
    slots than samples (memory-bound) than ever before prints again (issue 39)."""
    from types import SimpleNamespace

    from megatron_grpo.rollout.engine.kv_cache import CacheSizer

    engine = CacheSizer.__new__(CacheSizer)
    engine._reported_slots = None

    def report(slots: int, samples: int) -> str:
        cache = SimpleNamespace(slots=slots, seq_len=16, kv=torch.zeros(4))
        engine._report(cache, samples, 64, "a budget")
        return capsys.readouterr().out

    assert report(32, 32).startswith("rollout: KV cache")  # the first call
    assert report(8, 8) == ""  # a smaller batch (evaluation): same cache budget
    assert report(32, 32) == ""
    assert report(4, 32).startswith("rollout: KV cache")  # memory-bound, fewer than ever
