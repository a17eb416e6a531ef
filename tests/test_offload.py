"""``training.offload_during_rollout`` (``train/offload.py``): the optimizer state, main params
and main grads leave the device and come back bit for bit, under megatron-core's
DistributedOptimizer and its plain (non-sharded) optimizers, fp32 and bf16; a training run with
offload equals one without; ``auto`` decides from the memory plan; config errors name the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny.yaml"


def _snapshot(offload) -> dict[int, torch.Tensor]:
    from megatron_grpo.train import optimizer_memory as om

    tensors = [*om.state_tensors(offload.optimizer), *om.main_params(offload.optimizer)]
    tensors += offload._grad_buffers()
    return {id(t): t.detach().clone() for t in tensors}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _same(offload, before: dict[int, torch.Tensor]) -> None:
    from megatron_grpo.train import optimizer_memory as om

    tensors = [*om.state_tensors(offload.optimizer), *om.main_params(offload.optimizer)]
    tensors += offload._grad_buffers()
    assert {id(t) for t in tensors} == set(before)  # the same objects, not replacements
    for t in tensors:
        want = before[id(t)]
        assert t.dtype == want.dtype and torch.equal(_bits(t), _bits(want))


def _round_trip(dist_opt: bool, dtype: str) -> None:
    from megatron_grpo.megatron import (
        ParallelConfig,
        build_model,
        destroy_parallel,
        initialize_parallel,
        unwrap,
    )
    from megatron_grpo.train.config import OptimizerConfig
    from megatron_grpo.train.offload import RolloutOffload
    from megatron_grpo.train.optim import build_optimizer, optimizer_step, zero_grads
    from tests.megatron_utils import tiny_model

    destroy_parallel()
    initialize_parallel(ParallelConfig(), 3)
    cfg = tiny_model(params_dtype=dtype)
    chunks = build_model(cfg, ParallelConfig(), use_distributed_optimizer=dist_opt)
    opt_cfg = OptimizerConfig(lr=1e-2, use_distributed_optimizer=dist_opt)
    optimizer, scheduler = build_optimizer(opt_cfg, chunks, 10)
    g = torch.Generator().manual_seed(1)
    for p in unwrap(chunks[0]).parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=g))
    optimizer_step(optimizer, scheduler)  # creates the Adam state
    for p in unwrap(chunks[0]).parameters():  # non-zero grads: copied, not dropped
        p.main_grad.copy_(torch.randn(p.shape, generator=g))
    weights = {n: p.detach().clone() for n, p in unwrap(chunks[0]).named_parameters()}
    offload = RolloutOffload(chunks, optimizer, enabled=True)
    before = _snapshot(offload)
    assert len(before) > 0
    offload.offload()
    moved = offload._moved
    assert moved and all(m.storage.nbytes() == 0 for m in moved)
    assert all(m.host is not None for m in moved)  # nothing was all zeros
    for n, p in unwrap(chunks[0]).named_parameters():  # the engine's weights stay
        assert torch.equal(p, weights[n]), n
    offload.reload()
    _same(offload, before)
    # Zeroed gradient buffers travel as "zeros" (no copy) and come back zeroed.
    zero_grads(chunks, optimizer)
    before = _snapshot(offload)
    with offload.during_rollout():
        grads = [m for m in offload._moved if m.host is None]
        assert grads and all(m.storage.nbytes() == 0 for m in offload._moved)
    assert offload._moved == [] and offload.seconds >= 0.0
    _same(offload, before)
    # the optimizer still steps from the reloaded state, as it would have
    optimizer_step(optimizer, scheduler)
    _measured_switch(chunks, optimizer)


class _Shortfalls:
    """A stand-in :class:`MeasuredCheck`: the bytes the cache lacks at each call, in turn."""

    def __init__(self, *shorts: float) -> None:
        self.shorts, self.calls = list(shorts), 0

    def short(self, device) -> float:
        self.calls += 1
        return self.shorts.pop(0)


def _measured_switch(chunks, optimizer) -> None:
    """``auto`` left off by the plan: off while the measured memory suffices, on from the
    first step it does not (said once), and not measured again after."""
    from megatron_grpo.train.offload import RolloutOffload

    said: list[str] = []
    check = _Shortfalls(-1.0, 3 * 2**29)
    offload = RolloutOffload(chunks, optimizer, False, check, said.append, pending=True)
    offload.on_enable = lambda: said.append(f"re-planned, enabled={offload.enabled}")
    with offload.during_rollout(0):
        assert offload._moved == [] and not offload.enabled
    with offload.during_rollout(1):
        assert offload.enabled and offload._moved
    # what depends on the decision hears of it once (the trainer: the update graphs)
    assert said[1:] == ["re-planned, enabled=True"], said
    said.pop()
    assert said == [RolloutOffload.check_line(1, 3 * 2**29)] and "1.50 GiB" in said[0]
    assert "on from step 2" in said[0]
    with offload.during_rollout(2):
        assert offload._moved
    assert check.calls == 2 and offload._moved == []
    forced = RolloutOffload(chunks, optimizer, True, _Shortfalls(), said.append, pending=True)
    with forced.during_rollout(0):  # already on, no graphs: nothing to measure
        assert forced._moved
    assert not forced.pending and forced.check.calls == 0
    _graphs_yield(chunks, optimizer)


def _graphs_yield(chunks, optimizer) -> None:
    """Where the cache lacks room, the training passes' graphs are dropped first (under any
    setting, said once), and ``auto`` turns offload on only if it still lacks room after."""
    from megatron_grpo.train.offload import RolloutOffload

    gib = 2**30
    said: list[str] = []
    drops: list[int] = []

    def drop() -> int:  # what GRPOStep.drop_graphs returns: how many it held
        drops.append(1)
        return 3

    # ``false``: never offloads; the graphs yield at each rollout that lacks room
    check = _Shortfalls(2 * gib, gib / 2, -1.0, gib, -1.0)
    off = RolloutOffload(chunks, optimizer, False, check, said.append)
    off.drop_graphs = drop
    for step in range(3):
        with off.during_rollout(step):
            assert not off.enabled and off._moved == []
    assert check.calls == 5 and len(drops) == 2 and off.graph_drops == 2
    assert said == [RolloutOffload.drop_line(0, 2 * gib, gib / 2)], said
    assert "lack 2.00 GiB" in said[0] and "still 0.50 GiB short" in said[0]
    # ``auto``: the drop suffices at step 1; at step 2 it does not, so offload turns on, with
    # the shortfall left after the drop; once on, measured after the moves (room: no drop)
    said.clear()
    check = _Shortfalls(gib, -1.0, gib, gib / 4, -1.0, -1.0)
    auto = RolloutOffload(chunks, optimizer, False, check, said.append, pending=True)
    auto.drop_graphs = drop
    with auto.during_rollout(0):
        assert not auto.enabled
    with auto.during_rollout(1):
        assert auto.enabled and auto._moved
    with auto.during_rollout(2):
        assert auto._moved
    assert said[1:] == [RolloutOffload.check_line(1, gib / 4)], said
    assert check.calls == 6 and len(drops) == 4
    # ``false`` without graphs to drop: nothing measured
    bare = RolloutOffload(chunks, optimizer, False, _Shortfalls(), said.append)
    with bare.during_rollout(0):
        pass
    assert bare.check.calls == 0


def _round_trip_body(rank: int, world: int) -> None:
    for dist_opt in (True, False):
        for dtype in ("float32", "bfloat16"):
            _round_trip(dist_opt, dtype)
    _auto(rank, world)  # one spawned process for both


@pytest.mark.slow
def test_offload_round_trip_is_bit_exact_and_auto_decides_from_the_plan():
    """DistributedOptimizer and the plain optimizers (FP32Optimizer, Float16Optimizer); then
    ``auto`` (see ``_auto``)."""
    run_distributed(_round_trip_body, 1)


def _run(tmp: Path, tag: str, offload: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from megatron_grpo.megatron import unwrap
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    sets = [
        "parallel.tensor_model_parallel_size=1",
        "rollout.num_prompts=4",
        "training.micro_batch_size=16",
        "training.steps=2",
        "checkpoint.dir=null",
        "optimizer.use_distributed_optimizer=true",
        f"training.offload_during_rollout={offload}",
        f"logging.dir={tmp / tag}",
    ]
    trainer = Trainer(load_train_config(RECIPE, sets))
    history = trainer.train()
    weights = {n: p.detach().clone() for n, p in unwrap(trainer.model[0]).named_parameters()}
    return history, weights


def _equal_runs_body(rank: int, world: int, tmp: Path) -> None:
    off, w_off = _run(tmp, "off", "false")
    on, w_on = _run(tmp, "on", "true")
    for a, b in zip(off, on, strict=True):
        assert "perf/offload_seconds" not in a and b["perf/offload_seconds"] >= 0.0
        keys = {k for k in a if not k.startswith("perf/")}
        assert keys == {k for k in b if not k.startswith("perf/")}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert all(torch.equal(w_off[n], w_on[n]) for n in w_off)
    logged = [json.loads(x) for x in (tmp / "on" / "metrics.jsonl").read_text().splitlines()]
    assert all("perf/offload_seconds" in row for row in logged)


@pytest.mark.slow
def test_training_with_offload_equals_training_without(tmp_path):
    """The tiny recipe, 2 steps (4 optimizer steps), world of one: metrics and weights equal."""
    run_distributed(_equal_runs_body, 1, tmp_path)


def _auto(rank: int, world: int) -> None:
    """``auto`` turns on exactly when the cache of a step's samples would not fit with the
    planned optimizer state and grads on the GPU (device memory faked)."""
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.megatron.layout import ParallelLayout
    from megatron_grpo.rollout.engine import kv_cache as kvc
    from megatron_grpo.train import offload as off
    from megatron_grpo.train.config import load_train_config
    from tests.megatron_utils import build_layout

    cfg = load_train_config(RECIPE, ["parallel.tensor_model_parallel_size=1"])
    policy = unwrap(build_layout(ParallelConfig(), cfg.model)[0])
    layout = ParallelLayout()
    assert off.decide(cfg, policy, layout) == (False, "")  # CPU: nothing to size
    forced = load_train_config(RECIPE, ["training.offload_during_rollout=true"])
    on, line = off.decide(forced, policy, layout)
    assert on and line.startswith("training.offload_during_rollout=true")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(off, "_auto_off", lambda cfg, policy: "")
        mp.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
        total = 2**30
        mp.setattr(torch.cuda, "mem_get_info", lambda *a: (total, total))
        need, left, movable = off._cache_room(cfg, policy, layout)
        assert need > 0 and movable > 0
        samples = cfg.rollout.num_prompts * cfg.rollout.group_size
        shape = kvc.CacheShape.of(policy)
        assert need > samples * shape.bytes_per_token * 16  # 12 tokens -> one 128 bucket (16)
        # just enough memory with the state on the GPU: off; a byte less per GiB: on
        fits = int((need - left) / 0.9) + total + 2**20
        mp.setattr(torch.cuda, "mem_get_info", lambda *a: (fits, fits))
        on, line = off.decide(cfg, policy, layout)
        assert not on and line.startswith("training.offload_during_rollout=auto: off (")
        assert line.endswith("; measured again before each rollout)")
        tight = fits - int((2**20 + movable / 2) / 0.9)
        mp.setattr(torch.cuda, "mem_get_info", lambda *a: (tight, tight))
        on, line = off.decide(cfg, policy, layout)
        assert on and "auto: on" in line and "GiB" in line
        _measured(cfg, policy, layout, need, mp)
        # measured under any setting: the training passes' graphs yield to the cache
        assert off.measured_check(forced, policy, layout).need == need
    assert off.measured_check(cfg, policy, layout) is None  # CPU: memory does not decide


def _measured(cfg, policy, layout, need: float, mp: pytest.MonkeyPatch) -> None:
    """The check before each rollout applies the engine's sizing rule to the memory measured
    then: ``fraction x total - in use - fixed headroom`` against the samples' need."""
    from megatron_grpo.train import offload as off

    check = off.measured_check(cfg, policy, layout)
    assert check is not None and check.need == need and check.fixed > 0
    assert check.fraction == cfg.rollout.engine.kv_cache_fraction
    cuda = torch.device("cuda")  # a name only: the memory queries are faked
    assert check.short(torch.device("cpu")) == 0.0  # no device memory: nothing lacks
    total, cached = 2**32, 2**20  # the allocator's unused cache counts as free
    pool = [  # but not what CUDA-graph pools hold unused (only their graphs can take it)
        dict(device=0, segment_pool_id=(0, 0), total_size=2**21, allocated_size=2**20),
        dict(device=0, segment_pool_id=(1, 7), total_size=2**24, allocated_size=2**22),
        dict(device=1, segment_pool_id=(1, 3), total_size=2**26, allocated_size=0),
    ]
    mp.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: pool)
    mp.setattr(torch.cuda, "current_device", lambda: 0)
    cuda0 = torch.device("cuda", 0)
    from megatron_grpo.rollout.engine.memory_release import graph_pool_unused

    assert graph_pool_unused(cuda0) == 2**24 - 2**22 and graph_pool_unused(cuda) == 2**24 - 2**22
    mp.setattr(torch.cuda, "memory_reserved", lambda *a: cached + 2**24 - 2**22)
    for lacks in (-(2**20), 2**25):
        free = int(need + check.fixed - lacks - check.fraction * total + total) - cached
        mp.setattr(torch.cuda, "mem_get_info", lambda *a, free=free: (free, total))
        assert abs(check.short(cuda) - lacks) < 1.0


def test_offload_config_errors_name_the_field():
    from megatron_grpo.config import ConfigError
    from megatron_grpo.train.config import load_train_config

    assert load_train_config(RECIPE).training.offload_during_rollout == "auto"
    for value in ("true", "false", "auto"):
        cfg = load_train_config(RECIPE, [f"training.offload_during_rollout={value}"])
        assert cfg.training.offload_during_rollout == {"true": True, "false": False}.get(
            value, "auto"
        )
    with pytest.raises(ConfigError, match="training.offload_during_rollout"):
        load_train_config(RECIPE, ["training.offload_during_rollout=maybe"])
    files = ["training.offload_during_rollout=true", "rollout.input_path=rollouts.jsonl"]
    with pytest.raises(ConfigError, match=r"offload_during_rollout: true needs generated"):
        load_train_config(RECIPE, files)
