"""``rollout.separate.in_flight_updates``: a generation replica swaps a newer version in between
engine steps, and its unfinished requests continue under it (``separate/parts.run_in_flight``).

The tokens before the swap are the old weights' (the run without a swap's), those after it are
exactly the new weights' continuation of that prefix, each tagged with its own version; a
separate run with the swaps made at fixed points is reproducible and its tokens lag less.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_separate_placement import _overrides

N, MAX_NEW = 6, 12


class _Flight:
    """A stand-in ``InFlight``: a newer version is ready at the ``at``-th engine check."""

    def __init__(self, model: torch.nn.Module, new: list[torch.Tensor], at: int) -> None:
        self.model, self.new, self.at = model, new, at
        self.version, self.checks, self.swaps = 0, 0, 0

    def ready(self, finished: torch.Tensor) -> bool:
        self.checks += 1
        return self.version == 0 and self.checks >= self.at

    def swap(self) -> None:
        with torch.no_grad():  # in place, as WeightReceiver.swap: the storage stays
            for p, w in zip(self.model.parameters(), self.new, strict=True):
                p.copy_(w)
        self.version, self.swaps = 1, self.swaps + 1


def _unit_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import ParallelConfig, unwrap
    from megatron_grpo.rollout import EngineOptions, KVCacheEngine, SamplingParams
    from megatron_grpo.rollout.engine.requests import Request
    from megatron_grpo.rollout.separate.parts import run_in_flight
    from tests.megatron_utils import build_layout, tiny_model

    cfg = tiny_model(init_method_std=0.3)
    model = unwrap(build_layout(ParallelConfig(), cfg)[0])
    engine = KVCacheEngine(model, EngineOptions(kv_cache_gib=0.01, context_bucket=16))
    params = SamplingParams(
        max_new_tokens=MAX_NEW, eos_id=cfg.vocab_size - 1, vocab_size=cfg.vocab_size
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (4 + i,), generator=g).tolist() for i in range(N)]
    uniforms = torch.rand(N, MAX_NEW, generator=g)

    def requests() -> list[Request]:  # staggered limits: rows finish at different steps
        pairs = enumerate(zip(prompts, uniforms, strict=True))
        return [Request(p, u.clone(), limit=3 + 2 * i) for i, (p, u) in pairs]

    old_weights = [p.detach().clone() for p in model.parameters()]
    new = [w + 0.5 * torch.randn(w.shape, generator=g).to(w.dtype) for w in old_weights]
    old = requests()
    engine.run_requests(old, params, 0)
    flight = _Flight(model, new, at=3)
    flown = requests()
    run_in_flight(SimpleNamespace(engine=engine, params=params, record_routes=False), flown, flight)
    assert flight.swaps == 1 and all(r.finished for r in flown)
    spanned = 0
    for a, b in zip(old, flown, strict=True):
        k = b.versions.count(0)
        assert b.versions == [0] * k + [1] * (len(b.tokens) - k)  # one switch, in order
        assert b.tokens[:k] == a.tokens[:k] and b.logprobs[:k] == a.logprobs[:k]
        spanned += 0 < k < len(b.tokens)
        # after the swap: the new weights' own continuation of the old prefix
        ref = Request(b.prompt, b.uniforms.clone(), b.limit, b.tokens[:k], b.logprobs[:k], [0] * k)
        if k < len(b.tokens):
            engine.run_requests([ref], params, 1)
            assert ref.tokens == b.tokens and ref.versions == b.versions
            torch.testing.assert_close(ref.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert spanned >= 2, "the swap landed between requests, not inside them"
    assert any(a.tokens != b.tokens for a, b in zip(old, flown, strict=True))  # weights matter


def test_requests_continue_under_the_version_swapped_in():
    run_distributed(_unit_body, 1)


# ---------------------------------------------------------------------------- end to end
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_long.yaml"
IN_FLIGHT = (
    "rollout.placement=separate",
    "rollout.separate.generation_ranks=1",
    "rollout.separate.max_staleness=1",
    "rollout.separate.in_flight_updates=true",
    "rollout.reverse_digits.num_digits=12",
    "rollout.max_prompt_length=16",
    "rollout.max_response_length=13",
    "rollout.sampling.ignore_eos=true",  # 13 tokens each: a swap after 5 lands mid-request
)


def _swap_at_fixed_points() -> None:
    """Make the swaps deterministic: in a part that a newer version will reach (its step is
    past the version held), at the second engine check (after the prefill and four decode
    steps: ``parts.CHECK_EVERY`` bounds a stream), wait for that version and swap it in."""
    from megatron_grpo.rollout.separate import generation, parts

    parts.CHECK_EVERY = 4  # responses here are 13 tokens
    loop = generation.GenerationLoop
    unit = loop._unit

    def tracked(self, step, *args) -> None:
        self.step, self.checks = step, 0
        unit(self, step, *args)

    def ready(self, finished) -> bool:
        self.checks += 1
        if self.step <= self.version or self.checks != 2:
            return False
        while not self._receive():  # the trainer sends it after its current step (TP ranks agree)
            time.sleep(0.01)
        return True

    loop._unit, loop.ready = tracked, ready


def _e2e_body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.rollout.separate.launch import run_generation_rank
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    _swap_at_fixed_points()
    for name in ("a", "b"):
        cfg = load_train_config(RECIPE, _overrides(tmp, name, "training.steps=3", *IN_FLIGHT))
        if (end := run_generation_rank(cfg)) is None:
            Trainer(cfg, overwrite=True).train()
        else:
            assert end == "finished", end


def _tp2_replica_body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.rollout.separate.launch import run_generation_rank
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    _swap_at_fixed_points()
    tp2 = ("rollout.separate.generation_ranks=2", "rollout.separate.tensor_model_parallel_size=2")
    cfg = load_train_config(RECIPE, _overrides(tmp, "a", "training.steps=3", *IN_FLIGHT, *tp2))
    if (end := run_generation_rank(cfg)) is None:
        Trainer(cfg, overwrite=True).train()
    else:
        assert end == "finished", end


@pytest.mark.slow
def test_a_tp2_replica_receives_and_swaps_with_both_ranks(tmp_path):
    """1 trainer + one TP2 replica: its two ranks post each version's receives, pause and swap
    at the same engine step (``GenerationLoop._receive``'s agreement; a rank alone in a
    collective would hang), so the swaps land as with a TP1 replica."""
    run_distributed(_tp2_replica_body, 3, tmp_path)
    _check_swaps(tmp_path, "a")


def _check_swaps(tmp: Path, name: str) -> None:
    import json

    rows = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/in_flight_swaps"] for m in rows] == [0.0, 1.0, 1.0]
    assert [m["rollout/policy_lag_max"] for m in rows] == [0.0, 1.0, 1.0]
    assert all(0.0 < m["rollout/policy_lag_mean"] < 1.0 for m in rows[1:])


@pytest.mark.slow
def test_in_flight_swaps_freshen_tokens_and_keep_the_run_reproducible(tmp_path):
    """1 trainer + 1 generator, max_staleness 1: units 1 and 2 start on the previous version
    and swap the newest in mid-part; their tokens lag 0 or 1 versions, never more."""
    run_distributed(_e2e_body, 2, tmp_path)
    _check_swaps(tmp_path, "a")
    rollouts = {n: sorted((tmp_path / n / "rollouts").iterdir()) for n in ("a", "b")}
    assert [p.read_text() for p in rollouts["a"]] == [p.read_text() for p in rollouts["b"]]


@pytest.mark.gpu
def test_gpu_in_flight_swaps_over_nccl(tmp_path):
    """2 GPUs: the same with the weights over NCCL (the receiver's CUDA-event poll)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(_e2e_body, 2, tmp_path, backend="nccl", timeout=300)
    _check_swaps(tmp_path, "a")
    _check_swaps(tmp_path, "b")


@pytest.mark.parametrize(
    "extra, match",
    [
        (("rollout.engine.kind=recompute",), "needs engine.kind: kv_cache, got"),
        (("rollout.separate.max_staleness=0",), "needs separate.max_staleness >= 1"),
    ],
)
def test_in_flight_config_errors_name_the_field(tmp_path, extra, match):
    from megatron_grpo.config import ConfigError
    from megatron_grpo.train.config import load_train_config

    with pytest.raises((ConfigError, ValueError), match=match):
        load_train_config(RECIPE, _overrides(tmp_path, "x", *IN_FLIGHT, *extra))
