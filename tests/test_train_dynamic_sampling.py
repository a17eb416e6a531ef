"""Dynamic sampling (``rollout.filter_groups``): zero-variance groups are dropped and replaced by
groups of fresh prompts, rounds stop at the cap (zero-variance groups then fill the batch), the
counts are exact, and under DP every rank runs the same rounds and a fresh source (a resumed
run) draws the same batch as a continuing one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.dynamic_sampling import (
    ALL_CORRECT,
    ALL_PARTIAL,
    ALL_WRONG,
    EXTRA_PROMPTS_BASE,
    INFORMATIVE,
    FilteredRollouts,
    classify_group,
    extra_round_first_prompt,
    maybe_filter,
    merge_round_metrics,
)
from megatron_grpo.train.config import load_train_config
from tests.dist_utils import run_distributed

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
G = 4  # group size of these tests


def _cfg(*extra: str):
    sets = [
        "rollout.num_prompts=4",
        f"rollout.group_size={G}",
        "rollout.filter_groups.enabled=true",
    ]
    return load_train_config(RECIPE, [*sets, *extra])


_REWARDS = {
    "mixed": [1.0] + [0.0] * (G - 1),
    "correct": [1.0] * G,
    "wrong": [0.0] * G,
    "partial": [0.5] * G,
    "nearly": [0.5, 0.5 + 1e-7, 0.5, 0.5],  # spread 1e-7: zero variance at the default tolerance
}


class _Scripted:
    """A round source whose group rewards follow ``kind(prompt index)``; records its calls."""

    generated = True

    def __init__(self, cfg, kind, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.cfg, self.kind, self.dp_rank = cfg, kind, dp_rank
        self.per_rank = cfg.rollout.num_prompts // dp_size
        self.calls: list[tuple[int, int]] = []
        self.counts: list[int] = []  # prompts per call

    def next(self, step: int, round: int = 0, count: int | None = None) -> RolloutBatch:
        count = self.per_rank if count is None else count
        self.calls.append((step, round))
        self.counts.append(count)
        if round == 0:
            start = step * self.cfg.rollout.num_prompts + self.dp_rank * self.per_rank
        else:
            start = extra_round_first_prompt(
                self.cfg.rollout.num_prompts, step, round, self.dp_rank, self.per_rank
            )
        ids = [start + k for k in range(count) for _ in range(G)]
        rewards = [r for k in range(count) for r in _REWARDS[self.kind(start + k)]]
        responses = [[1] * (1 + j % 3) for j in range(len(ids))]  # 1, 2 or 3 tokens
        return RolloutBatch([[11, 10]] * len(ids), responses, ids, None, rewards)

    def metrics(self) -> dict[str, float]:
        return {"rollout/decode_steps": 2.0, "rollout/kv_slots": float(len(self.calls))}


def _filtered(cfg, kind) -> tuple[FilteredRollouts, _Scripted]:
    inner = _Scripted(cfg, kind)
    return FilteredRollouts(inner, cfg.rollout.filter_groups, 4), inner


@pytest.mark.parametrize(
    ("rewards", "loss_tokens", "tolerance", "kind"),
    [
        ([1.0, 1.0, 1.0], [2, 2, 2], 1e-6, ALL_CORRECT),
        ([0.0, 0.0], [1, 1], 1e-6, ALL_WRONG),
        ([0.5, 0.5], [1, 1], 1e-6, ALL_PARTIAL),
        ([0.0, 1.0], [1, 1], 1e-6, INFORMATIVE),
        ([0.5, 0.5 + 1e-7], [1, 1], 1e-6, ALL_PARTIAL),  # within the tolerance
        ([0.5, 0.5 + 1e-7], [1, 1], 1e-8, INFORMATIVE),
        ([1.0 - 1e-7, 1.0 - 1e-7], [1, 1], 1e-6, ALL_CORRECT),
        ([1.0, 0.0, 1.0], [3, 0, 1], 0.0, ALL_CORRECT),  # the sample without loss tokens is out
        ([1.0, 0.0], [3, 0], 0.0, ALL_CORRECT),  # one counted sample: nothing to compare
        ([1.0, 0.0], [0, 0], 0.0, ALL_PARTIAL),  # no counted sample
        ([2.0, 2.0], [1, 1], 0.0, ALL_CORRECT),  # above the [0, 1] scale
        ([-1.0, -1.0], [1, 1], 0.0, ALL_WRONG),
    ],
)
def test_classify_group(rewards, loss_tokens, tolerance, kind):
    assert classify_group(rewards, loss_tokens, tolerance) == kind


def test_zero_variance_groups_are_dropped_and_replaced_by_fresh_prompts():
    cfg = _cfg()
    base = {0: "mixed", 1: "correct", 2: "wrong", 3: "partial"}
    source, inner = _filtered(cfg, lambda i: base.get(i, "mixed"))
    batch = source.next(0)
    assert inner.calls == [(0, 0), (0, 1)]  # one extra round was enough
    first = extra_round_first_prompt(cfg.rollout.num_prompts, 0, 1, 0, 4)
    assert first >= EXTRA_PROMPTS_BASE
    assert list(dict.fromkeys(batch.group_ids)) == [0, first, first + 1, first + 2]
    assert batch.rewards == _REWARDS["mixed"] * 4 and len(batch) == 4 * G
    m = source.metrics()
    counts = {k: m[f"rollout/{k}"] for k in ("filter_rounds", "groups_generated", "groups_kept",
                                             "groups_filled", "groups_all_correct",
                                             "groups_all_wrong", "groups_all_partial")}  # fmt: skip
    assert counts == {
        "filter_rounds": 2.0, "groups_generated": 8.0, "groups_kept": 4.0, "groups_filled": 0.0,
        "groups_all_correct": 1.0, "groups_all_wrong": 1.0, "groups_all_partial": 1.0,
    }  # fmt: skip
    assert m["rollout/groups_zero_variance_frac"] == 3 / 8
    assert m["rollout/generated_tokens"] == 2 * sum(1 + j % 3 for j in range(4 * G))
    assert m["rollout/reward_mean_generated"] == pytest.approx((5 * 1 + G + G * 0.5) / 32)
    # merged over the rounds: decode steps add up, kv slots are the largest
    assert m["rollout/decode_steps"] == 4.0 and m["rollout/kv_slots"] == 2.0


def test_extra_prompts_are_new_for_every_step_round_and_rank():
    cfg = load_train_config(RECIPE, ["rollout.num_prompts=8"])
    starts = [
        extra_round_first_prompt(cfg.rollout.num_prompts, step, rnd, rank, 4)
        for step in range(3) for rnd in (1, 2, 1024) for rank in range(2)
    ]  # fmt: skip
    ranges = sorted((s, s + 4) for s in starts)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert ranges[0][0] >= EXTRA_PROMPTS_BASE > 10**9 * 8
    with pytest.raises(ValueError, match="extra round"):
        extra_round_first_prompt(cfg.rollout.num_prompts, 0, 0, 0, 4)


@pytest.mark.parametrize(("tolerance", "rounds"), [("1e-6", 2), ("1e-8", 1)])
def test_the_tolerance_decides_what_is_dropped(tolerance, rounds):
    cfg = _cfg(f"rollout.filter_groups.reward_tolerance={tolerance}")
    source, inner = _filtered(cfg, lambda i: "nearly" if i == 1 else "mixed")
    batch = source.next(0)
    assert len(inner.calls) == rounds
    assert (1 in batch.group_ids) == (rounds == 1)


def test_rounds_stop_at_the_cap_and_the_earliest_zero_variance_groups_fill():
    cfg = _cfg("rollout.filter_groups.max_extra_rounds=2")
    informative = extra_round_first_prompt(
        cfg.rollout.num_prompts, 0, 2, 0, 4
    )  # round 2's first group
    source, inner = _filtered(cfg, lambda i: "mixed" if i == informative else "correct")
    batch = source.next(0)
    assert inner.calls == [(0, 0), (0, 1), (0, 2)]
    # the informative group plus base groups 0, 1, 2, in generation order
    assert list(dict.fromkeys(batch.group_ids)) == [0, 1, 2, informative]
    m = source.metrics()
    assert (m["rollout/groups_kept"], m["rollout/groups_filled"]) == (1.0, 3.0)
    assert m["rollout/groups_all_correct"] == 11.0 and m["rollout/filter_rounds"] == 3.0


@pytest.mark.parametrize(("round_size", "counts"), [("full", [4, 4]), ("shortfall", [4, 2])])
def test_shortfall_rounds_generate_what_the_missing_groups_need(round_size, counts):
    cfg = _cfg(f"rollout.filter_groups.round_size={round_size}")
    source, inner = _filtered(cfg, lambda i: "correct" if i == 1 else "mixed")
    batch = source.next(0)
    # 3 informative groups of 4: the missing one needs ceil(1 * 4 / 3) = 2 prompts
    assert inner.counts == counts
    first = extra_round_first_prompt(cfg.rollout.num_prompts, 0, 1, 0, 4)
    assert list(dict.fromkeys(batch.group_ids)) == [0, 2, 3, first]
    assert source.metrics()["rollout/groups_generated"] == sum(counts)


def test_shortfall_rounds_are_full_while_no_group_is_informative():
    cfg = _cfg("rollout.filter_groups.round_size=shortfall")
    mixed = extra_round_first_prompt(cfg.rollout.num_prompts, 0, 1, 0, 4) + 3
    source, inner = _filtered(cfg, lambda i: "mixed" if i == mixed else "wrong")
    source.next(0)
    # round 1 (full): 1 informative of 8 generated -> 3 missing need 24 prompts, capped at 4
    assert inner.counts == [4, 4, 4, 4, 4]


def test_no_extra_rounds_trains_the_unfiltered_batch_and_counts():
    cfg = _cfg("rollout.filter_groups.max_extra_rounds=0")
    kinds = ["wrong", "mixed", "correct", "mixed"]
    source, inner = _filtered(cfg, lambda i: kinds[i % 4])
    assert source.next(1) == inner.next(1)
    m = source.metrics()
    assert m["rollout/filter_rounds"] == 1.0 and m["rollout/groups_kept"] == 2.0
    assert m["rollout/groups_filled"] == 2.0 and m["rollout/groups_zero_variance_frac"] == 0.5


def test_same_seed_same_batch_and_disabled_is_a_no_op():
    kinds = ["wrong", "mixed", "correct", "partial", "mixed", "correct"]
    cfg = _cfg()
    runs = [_filtered(cfg, lambda i: kinds[i % 6])[0] for _ in range(2)]
    assert runs[0].next(3) == runs[1].next(3) and runs[0].metrics() == runs[1].metrics()
    inner = _Scripted(cfg, lambda i: "mixed")
    assert (
        maybe_filter(_cfg("rollout.filter_groups.enabled=false").rollout, inner, 1, None) is inner
    )
    assert isinstance(maybe_filter(cfg.rollout, inner, 2, None), FilteredRollouts)


def test_engine_metrics_merge_over_rounds():
    rounds = [
        {"rollout/kv_slots": 8.0, "rollout/decode_steps": 3.0, "rollout/decode_batch_mean": 6.0,
         "perf/decode_seconds": 0.5},
        {"rollout/kv_slots": 5.0, "rollout/decode_steps": 1.0, "rollout/decode_batch_mean": 2.0,
         "perf/decode_seconds": 0.25},
    ]  # fmt: skip
    assert merge_round_metrics(rounds) == {
        "rollout/kv_slots": 8.0, "rollout/decode_steps": 4.0, "rollout/decode_batch_mean": 5.0,
        "perf/decode_seconds": 0.75,
    }  # fmt: skip


class _ScriptedTask:
    """The toy task's prompts (answer = the prompt's index). Prompt 4 (rank 1's first base prompt
    of step 0 at DP = 2) is solved by every sample; the others reward only the group's first
    sample, so they are informative."""

    def __init__(self, task) -> None:
        self.task, self.tokenizer, self.calls = task, task.tokenizer, 0

    def prompts(self, start: int, n: int):
        from megatron_grpo.rollout.tasks import Prompt

        ps = self.task.prompts(start, n)
        return [Prompt(p.ids, p.text, str(start + k)) for k, p in enumerate(ps)]

    def reward(self, prompt, response_ids) -> float:
        i, j = int(prompt.answer), self.calls % G  # samples are scored in order
        self.calls += 1
        return 1.0 if i == 4 else float(j == 0)


def _dp_body(rank: int, world: int, tmp: Path) -> None:
    import dataclasses

    import torch.distributed as dist

    from megatron_grpo.megatron.model.build import unwrap
    from megatron_grpo.rollout.source import GeneratedRollouts
    from megatron_grpo.train.trainer import Trainer

    cfg = _cfg(
        "parallel.tensor_model_parallel_size=1", "rollout.num_prompts=8",
        "training.micro_batch_size=8", "training.steps=1", "training.mini_batches_per_step=1",
        f"logging.dir={tmp}", "checkpoint.dir=null", "logging.progress_bar=false",
        "training.use_reference_model=false",
    )  # fmt: skip
    trainer = Trainer(cfg)
    toy = trainer.source.inner.task
    ctx = cfg.rollout_context()

    def source(round_size: str = "full") -> FilteredRollouts:
        inner = GeneratedRollouts(
            cfg.rollout, ctx, _ScriptedTask(toy), unwrap(trainer.model[0]), rank, world
        )
        calls, generate = [], inner.next
        inner.next = lambda *args: calls.append(args) or generate(*args)
        inner.calls = calls
        f = dataclasses.replace(cfg.rollout.filter_groups, round_size=round_size)
        return FilteredRollouts(inner, f, 4, trainer.source.dp_group)

    def all_calls(s: FilteredRollouts) -> list:
        out = [None] * world
        dist.all_gather_object(out, s.inner.calls)
        return out

    running = source()
    step0, m0 = running.next(0), running.metrics()
    step1 = running.next(1)
    # rank 1 lacked a group after round 0: rank 0 generated round 1 with it
    assert all_calls(running) == [[(0, 0, 4), (0, 1, 4), (1, 0, 4)]] * 2
    assert (m0["rollout/filter_rounds"], m0["rollout/groups_generated"]) == (2.0, 16.0)
    assert (m0["rollout/groups_all_correct"], m0["rollout/groups_kept"]) == (1.0, 8.0)
    extra = extra_round_first_prompt(cfg.rollout.num_prompts, 0, 1, rank, 4)
    want = [0, 1, 2, 3] if rank == 0 else [5, 6, 7, extra]
    assert list(dict.fromkeys(step0.group_ids)) == want
    # a resumed run builds its source fresh at step 1: the same batch, token for token
    assert source().next(1) == step1
    # shortfall: 1 group short at 3 informative of 4 -> 2 prompts, on both ranks
    small = source("shortfall")
    assert small.next(0) == step0 and all_calls(small) == [[(0, 0, 4), (0, 1, 2)]] * 2
    # round 0 samples with the seeds of a run without filter_groups; every round has its own
    seeds = [running.inner.generator(0, k).initial_seed() for k in range(3)]
    assert seeds[0] == random.Random(f"{cfg.training.seed}/0/{rank}").getrandbits(63)
    assert len(set(seeds)) == 3
    trainer.source.inner.task = _ScriptedTask(toy)
    [metrics] = trainer.train()
    assert metrics["rollout/groups_kept"] == 8.0 and metrics["rollout/filter_rounds"] == 2.0
    trained = metrics["response/length_mean"] * 8 * G
    assert metrics["rollout/generated_tokens"] > trained


@pytest.mark.slow
def test_dp2_ranks_run_the_same_rounds_and_resume_draws_the_same_batch(tmp_path):
    run_distributed(_dp_body, 2, tmp_path)
