"""The ``evaluation:`` section: config checks, sampling parameters, the DP split, the metrics
(pass@1 / pass@n / per data_source), and an Evaluator over 2 DP ranks with a stubbed generation:
every validation sample scored exactly once, padding neither scored nor counted, both ranks get
the same metrics, evaluations at step 0, every interval and the last step. The end-to-end run
(TP 2, a converted model, the trainer's loop) is tests/test_byo_task.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.config import ConfigError
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.rollout.evaluation import (
    Evaluator,
    eval_metrics,
    eval_sampling_params,
    group_sums,
    shard,
)
from megatron_grpo.rollout.source import sampling_params
from megatron_grpo.rollout.tasks import Prompt
from megatron_grpo.rollout.tasks.reverse_digits import DigitTokenizer
from megatron_grpo.train.config import TrainConfig, load_train_config
from tests.dist_utils import run_distributed

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
DATASET = [
    "rollout.task=dataset", "rollout.dataset.train_files=[t.jsonl]",
    "rollout.dataset.tokenizer_dir=tok", "rollout.dataset.val_files=[v.jsonl]",
]  # fmt: skip
N, STEPS, INTERVAL = 3, 5, 2


def _cfg(*overrides: str) -> TrainConfig:
    return load_train_config(RECIPE, [*DATASET, "evaluation.interval=2", *overrides])


# ---- config -------------------------------------------------------------------------------------


def test_defaults_off_and_overrides():
    def fields(e):
        return e.interval, e.n_samples, e.temperature, e.max_prompts, e.enabled

    assert fields(load_train_config(RECIPE).evaluation) == (0, 1, 0.0, None, False)
    cfg = _cfg("evaluation.n_samples=4", "evaluation.temperature=0.7", "evaluation.max_prompts=8")
    assert fields(cfg.evaluation) == (2, 4, 0.7, 8, True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["evaluation.interval=3"], "evaluation.interval=3 evaluates on validation prompts: it "
         "needs rollout.task: dataset with rollout.dataset.val_files"),
        ([*DATASET[:3], "evaluation.interval=3"], "rollout.dataset.val_files is empty"),
        ([*DATASET, "evaluation.interval=1", "evaluation.n_samples=2"],
         "evaluation: n_samples=2 needs temperature > 0"),
        ([*DATASET, "evaluation.interval=-1"], "evaluation.interval must be >= 0"),
        ([*DATASET, "evaluation.temperature=-1"], "evaluation.temperature must be >= 0"),
        ([*DATASET, "evaluation.max_prompts=0"], "evaluation.max_prompts must be positive"),
        ([*DATASET, "evaluation.interval=1", "parallel.pipeline_model_parallel_size=2"],
         "parallel.pipeline_model_parallel_size = 1"),
        (["evaluation.intervall=1"], "did you mean 'interval'"),
    ],
)  # fmt: skip
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_train_config(RECIPE, overrides)


def _eval_params(cfg):
    base = sampling_params(cfg.rollout, cfg.model.vocab_size, eos_id=12, task_stop_ids=[9])
    return eval_sampling_params(cfg.evaluation, base)


def _evaluator(cfg, task, layout):
    return Evaluator(cfg.evaluation, cfg.rollout, cfg.rollout_context(), task, layout)


def test_sampling_params_greedy_or_sampled():
    greedy = _eval_params(_cfg())
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (1.0, 1, 1.0)
    cfg = _cfg(
        "evaluation.temperature=0.6", "rollout.sampling.top_p=0.9", "rollout.sampling.top_k=5"
    )
    sampled = _eval_params(cfg)
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (0.6, 0, 1.0)
    assert sampled.max_new_tokens == cfg.rollout.max_response_length and sampled.stop_ids == (9,)


def test_shard_covers_every_prompt_once_with_equal_counts():
    for prompts in range(0, 12):
        for dp in (1, 2, 3, 4):
            blocks = [shard(prompts, d, dp) for d in range(dp)]
            assert [i for b, _ in blocks for i in b] == list(range(prompts))
            assert len({len(b) + pad for b, pad in blocks}) == 1


def _prompt(i: int, source: str) -> Prompt:
    return Prompt((11, i % 10, 10), str(i), str(i), data_source=source, source=f"v.jsonl:{i + 1}")


def test_metrics_pass_at_k_and_per_source():
    prompts = [_prompt(0, "a"), _prompt(1, "b"), _prompt(2, "a"), _prompt(3, "")]
    rewards = [1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0, 1.5, 2.0, 0.0, 0.0]  # 3 per prompt
    lengths = [2, 4, 6, 1, 1, 1, 3, 3, 3, 5, 5, 5]
    m = eval_metrics(group_sums(prompts, rewards, lengths, 3, ["a", "b"]), 3, ["a", "b"])
    assert m["eval/reward_mean"] == pytest.approx(sum(rewards) / 12)
    assert m["eval/pass_at_1"] == pytest.approx((1 / 3 + 0 + 1 + 1 / 3) / 4)
    assert m["eval/pass_at_3"] == pytest.approx(3 / 4)
    assert m["eval/response_length"] == pytest.approx(sum(lengths) / 12)
    assert m["eval/a/pass_at_1"] == pytest.approx((1 / 3 + 1) / 2)
    assert m["eval/a/reward_mean"] == pytest.approx((1.5 + 3.5) / 6)
    assert m["eval/b/pass_at_3"] == 0.0 and m["eval/b/response_length"] == 1.0
    assert not any(k.startswith("eval//") for k in m)  # no data_source: only in the totals
    one = eval_metrics(group_sums(prompts[:1], [1.0], [2], 1, []), 1, [])
    assert one == {"eval/reward_mean": 1.0, "eval/pass_at_1": 1.0, "eval/response_length": 2.0}


class _ValTask:
    """Five validation prompts (data sources even / odd, one without); the reward of response
    ``[d] * (i + 1) + [eos]`` (sample i of prompt d) is 1.0 when ``(d + i) % 3 == 0``."""

    def __init__(self, prompts: list[Prompt] | None = None) -> None:
        self.tokenizer = DigitTokenizer()
        self.calls: list[tuple[int, int]] = []
        sources = ["even", "odd", "even", "odd", ""]
        self.prompts = prompts if prompts is not None else [
            _prompt(d, sources[d]) for d in range(5)
        ]  # fmt: skip

    def val_prompts(self) -> list[Prompt]:
        return list(self.prompts)

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        d, i = prompt.ids[1], len(response_ids) - 2
        self.calls.append((d, i))
        return 1.0 if (d + i) % 3 == 0 else 0.25


def _expected() -> dict[str, float]:
    task = _ValTask()
    prompts = task.val_prompts()
    rewards = [task.reward(p, [0] * (i + 2)) for p in prompts for i in range(N)]
    lengths = [i + 2 for _ in prompts for i in range(N)]
    sources = ["even", "odd"]
    return eval_metrics(group_sums(prompts, rewards, lengths, N, sources), N, sources)


class _Monitor:
    def __init__(self) -> None:
        self.lines: list[tuple[int, dict]] = []
        self.messages: list[str] = []

    def log(self, step: int, metrics: dict) -> None:
        self.lines.append((step, metrics))

    def message(self, text: str) -> None:
        self.messages.append(text)


def _dp2_body(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    import megatron_grpo.rollout.evaluation as ev
    from megatron_grpo.megatron import ParallelConfig
    from megatron_grpo.megatron.parallel import destroy_parallel, initialize_parallel
    from megatron_grpo.rollout import Generation

    layout = initialize_parallel(ParallelConfig(tensor_model_parallel_size=1), seed=0)  # DP 2
    generated: list[int] = []

    def fake_generate(model, samples, params, generator, *, engine):
        assert engine == "recompute" and params.temperature == 0.5 and params.top_k == 0
        generated.append(len(samples))
        responses = [[s[1]] * (k % N + 1) + [12] for k, s in enumerate(samples)]
        return Generation(responses, [[0.0] * len(r) for r in responses])

    ev.generate = fake_generate
    try:
        cfg = _cfg(f"evaluation.n_samples={N}", "evaluation.temperature=0.5",
                   f"training.steps={STEPS}", "rollout.engine.kind=recompute")  # fmt: skip
        task = _ValTask()
        evaluator = _evaluator(cfg, task, layout)
        monitor = _Monitor()
        evaluator.attach(torch.nn.Linear(1, 1), None, monitor)
        evaluator.log_initial(0, monitor)
        evaluator.log_initial(3, monitor)  # a resumed run: no step-0 line
        due = {step: evaluator.after_step(step) for step in range(1, STEPS + 1)}
        assert [s for s, m in due.items() if m] == [2, 4, 5]  # interval 2 and the last step
        assert generated == [3 * N] * 4  # 5 prompts over 2 ranks: 3 each (rank 1 pads one)
        # each rank scored its own prompts' samples once per evaluation, no padding
        calls = sorted(task.calls)
        mine = [0, 1, 2] if rank == 0 else [3, 4]
        assert calls == sorted((d, i) for d in mine for i in range(N) for _ in range(4))
        want = _expected()
        assert [s for s, _ in monitor.lines] == [0]
        got = monitor.lines[0][1]
        assert got.pop("perf/eval_seconds") >= 0.0
        assert got == pytest.approx(want) and set(got) == set(want)
        assert due[5]["eval/pass_at_3"] == want["eval/pass_at_3"]
        both: list = [None, None]
        dist.all_gather_object(both, got)
        assert both[0] == both[1]
        assert monitor.messages[0].startswith("eval at step 0: reward ")
    finally:
        destroy_parallel()


def test_evaluator_over_two_dp_ranks():
    run_distributed(_dp2_body, 2, timeout=120)


def test_evaluator_off_or_without_prompts():
    off = _evaluator(load_train_config(RECIPE), None, ParallelLayout())
    assert not off.enabled and off.after_step(5) == {}
    off.attach(None, None)  # no-ops
    with pytest.raises(ValueError, match="rollout.dataset.val_files has no prompts left"):
        _evaluator(_cfg(), _ValTask(prompts=[]), ParallelLayout())
    limited = _evaluator(_cfg("evaluation.max_prompts=2"), _ValTask(), ParallelLayout())
    assert [p.text for p in limited.prompts] == ["0", "1"] and limited.sources == ["even", "odd"]
