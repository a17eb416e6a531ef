"""Rewards (issue 23): reward_fn forms and returns, built-in verifiers, scoring once per model
replica (2 gloo ranks at TP 2), the process pool and its timeouts, failures reaching every rank."""

from __future__ import annotations

import math
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.config import BUILTIN_VERIFIERS, RolloutConfig
from megatron_grpo.rollout.scoring import RewardScorer
from megatron_grpo.rollout.tasks import DigitTokenizer, Prompt, ReverseDigitsTask, build_task
from megatron_grpo.rollout.tasks.reward import (
    PluginReward,
    RewardError,
    load_reward_fn,
    reward_value,
)
from megatron_grpo.rollout.tasks.verifiers import VERIFIERS, extract_answer, to_number
from megatron_grpo.rollout.tasks.verifiers import exact_match as exact_match_verifier
from megatron_grpo.rollout.tasks.verifiers import math as math_verifier
from tests.dist_utils import run_distributed

TOK = DigitTokenizer()


def _prompt(answer: str = "21", source: str = "data/train.jsonl:3", **kw) -> Prompt:
    text = "<bos>12="
    return Prompt(tuple(TOK.encode(text)), text, answer, source=source, **kw)


def _ids(text: str, eos: bool = True) -> list[int]:
    return TOK.encode(text) + ([TOK.eos_id] if eos else [])


def _write(tmp_path: Path, body: str, name: str = "my_reward.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


class _Task:
    """A task whose reward is ``rollout.reward_fn`` (what build_task makes of it)."""

    def __init__(self, spec: str) -> None:
        self.tokenizer = TOK
        self.reward = PluginReward(load_reward_fn(spec), TOK)


def _scorer(spec: str, **cfg) -> RewardScorer:
    return RewardScorer(_Task(spec), RolloutConfig(**cfg))


# ------------------------------------------------------------------ calling conventions
@pytest.fixture
def rewards_module(monkeypatch):
    m = types.ModuleType("reward_forms")
    m.seen = []

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        m.seen.append((data_source, solution_str, ground_truth, extra_info))
        return solution_str == ground_truth  # a bool

    def verl_subset(solution_str, ground_truth):
        return float(solution_str == ground_truth)

    def verl_kwargs(**kwargs):
        m.seen.append(kwargs)
        return {"score": 0.5, "acc": True, "pred": "21"}

    def legacy(prompt, response, answer):
        m.seen.append((prompt, response, answer))
        return np.float32(0.25)

    def needs_more(solution_str, ground_truth, scale):
        return 0.0

    def two_args(prompt, response):
        return 0.0

    for fn in (verl, verl_subset, verl_kwargs, legacy, needs_more, two_args):
        setattr(m, fn.__name__, fn)
    monkeypatch.setitem(sys.modules, "reward_forms", m)
    return m


def test_verl_signature_gets_verl_keywords(rewards_module):
    reward = PluginReward(load_reward_fn("reward_forms:verl"), TOK)
    p = _prompt(data_source="openai/gsm8k", extra_info={"split": "train"})
    assert reward(p, _ids("21")) == 1.0  # bool -> 1.0 (eos stripped before decoding)
    assert reward(p, _ids("12")) == 0.0
    assert rewards_module.seen[0] == ("openai/gsm8k", "21", "21", {"split": "train"})
    args, kwargs = reward.call_args(_prompt(), _ids("2"))
    assert args == () and kwargs["extra_info"] == {}  # verl's default for rows without one


def test_verl_keyword_subset_and_kwargs(rewards_module):
    sub = PluginReward(load_reward_fn("reward_forms:verl_subset"), TOK)
    assert sub.call_args(_prompt(), _ids("21"))[1] == {"solution_str": "21", "ground_truth": "21"}
    assert sub(_prompt(), _ids("21")) == 1.0
    kw = PluginReward(load_reward_fn("reward_forms:verl_kwargs"), TOK)
    assert set(kw.call_args(_prompt(), _ids("1"))[1]) == {
        "data_source",
        "solution_str",
        "ground_truth",
        "extra_info",
    }


def test_legacy_signature(rewards_module):
    reward = PluginReward(load_reward_fn("reward_forms:legacy"), TOK)
    assert reward(_prompt(), _ids("21")) == 0.25  # numpy numbers are numbers
    assert rewards_module.seen[-1] == ("<bos>12=", "21", "21")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("reward_forms:needs_more", r"also requires \['scale'\]"),
        ("reward_forms:two_args", "must take verl's keywords"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("reward_forms:missing", "has no callable 'missing'"),
        ("reward_forms:", "must look like"),
        ("mathh", "must look like"),
    ],
)
def test_load_errors(rewards_module, spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)


def test_file_path_spec(tmp_path, monkeypatch):
    path = _write(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str == ground_truth)
        """,
    )
    reward = PluginReward(load_reward_fn(f"{path}:compute_score"), TOK)
    assert reward(_prompt(), _ids("21")) == 1.0
    monkeypatch.chdir(tmp_path)  # relative to the working directory
    assert load_reward_fn("my_reward.py:compute_score").keywords is not None
    with pytest.raises(ValueError, match="no file 'nope.py'"):
        load_reward_fn("nope.py:f")
    bad = _write(tmp_path, "def f(:\n", "broken.py")
    with pytest.raises(ValueError, match="loading .*broken.py' failed: SyntaxError"):
        load_reward_fn(f"{bad}:f")
    with pytest.raises(ValueError, match="has no callable 'g'"):
        load_reward_fn(f"{path}:g")


def test_build_task_uses_a_builtin_verifier_by_name():
    cfg = RolloutConfig(reward_fn="exact_match", max_prompt_length=8, max_response_length=4)
    task = build_task(cfg, seed=0)
    prompt = task.prompts(0, 1)[0]
    right = task.tokenizer.encode(prompt.answer) + [task.tokenizer.eos_id]
    assert task.reward(prompt, right) == 1.0
    assert task.reward(prompt, right[:1]) == 0.0


# ------------------------------------------------------------------ return values
def test_reward_values():
    assert reward_value(True, "f", "x") == (1.0, {})
    assert reward_value(np.bool_(False), "f", "x") == (0.0, {})
    assert reward_value(3, "f", "x") == (3.0, {})
    score, extras = reward_value({"score": 1, "acc": True, "len": 3, "pred": "7"}, "f", "x")
    assert score == 1.0 and extras == {"acc": 1.0, "len": 3.0}  # non-numbers are not logged


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1.0], "returned list for data/train.jsonl:3; expected a number"),
        (None, "returned NoneType for data/train.jsonl:3"),
        ({"acc": 1.0}, "returned a dict without 'score' for data/train.jsonl:3"),
        ({"score": "1"}, "returned a dict whose 'score' is str"),
        ({"score": 1.0, "mean": 2.0}, "the key 'mean'"),
        (float("nan"), "non-finite score nan"),
    ],
)
def test_bad_reward_values_name_function_and_source(value, message):
    with pytest.raises(RewardError, match=message) as info:
        reward_value(value, "my.mod:f", "data/train.jsonl:3")
    assert str(info.value).startswith("my.mod:f ")


def test_scorer_in_process_extras_and_errors(tmp_path):
    path = _write(
        tmp_path,
        """
        def dict_reward(solution_str, ground_truth):
            if solution_str == "1":
                return {"score": 0.0}  # no 'acc': NaN in the extras, left out of the mean
            return {"score": float(solution_str == ground_truth), "acc": 1.0, "format": 0.5}

        def bad_type(solution_str, ground_truth):
            return [1.0]

        def raises(solution_str, ground_truth):
            if solution_str == "9":
                raise ZeroDivisionError("boom")
            return 1.0
        """,
    )
    scorer = _scorer(f"{path}:dict_reward")
    assert scorer.is_scorer and scorer.steps == []  # a world of one: no communication
    prompts = [_prompt(), _prompt(), _prompt()]
    scores = scorer.score(prompts, [_ids("21"), _ids("1"), _ids("3")], [0, 0, 0])
    assert scores.rewards == [1.0, 0.0, 0.0]
    assert scores.extras["format"][0] == 0.5 and math.isnan(scores.extras["acc"][1])
    assert "timeouts" not in scores.extras  # only with rollout.reward_timeout_s

    with pytest.raises(RewardError, match=r"bad_type' .*returned list for data/train.jsonl:3"):
        _scorer(f"{path}:bad_type").score(prompts[:1], [_ids("2")], [0])
    unsourced = _prompt(source="")
    with pytest.raises(RewardError, match=r"raises' failed on prompt 17: ZeroDivisionError: boom"):
        _scorer(f"{path}:raises").score([unsourced] * 2, [_ids("2"), _ids("9")], [16, 17])


def test_rollout_batch_carries_reward_extras():
    def batch(extras):
        return RolloutBatch(
            [[1], [1]], [[2], [3]], [0, 0], rewards=[1.0, 0.0], reward_extras=extras
        )

    a, b = batch({"acc": [1.0, 0.0]}), batch(None)
    assert a.select([1]).reward_extras == {"acc": [0.0]}
    both = RolloutBatch.concat([a, b]).reward_extras
    assert both["acc"][:2] == [1.0, 0.0] and all(math.isnan(x) for x in both["acc"][2:])
    assert RolloutBatch.concat([b, b]).reward_extras is None
    with pytest.raises(ValueError, match=r"reward_extras\['acc'\] has 1 entries"):
        batch({"acc": [1.0]})


# ------------------------------------------------------------------ verifiers
def test_builtin_verifier_names_match_the_config():
    assert tuple(VERIFIERS) == BUILTIN_VERIFIERS


def test_exact_match():
    assert exact_match_verifier(solution_str=" 42\n", ground_truth="42") == 1.0
    assert exact_match_verifier(solution_str="42.0", ground_truth="42") == 0.0


@pytest.mark.parametrize(
    ("response", "truth", "want"),
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "0.75", 1.0),  # the last box
        ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
        ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),  # nested braces; strings without spaces
        ("She pays 18 dollars.\n#### 1,800", "1800", 1.0),  # GSM8K ####, thousands
        ("#### 2.50", "Natalia sold ... #### 2.5", 1.0),  # trailing zeros; the truth's ####
        ("#### 5", "5.0", 1.0),
        ("\\boxed{-3}", "\\boxed{-3.0}", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("the answer is 42", "42", 0.0),  # neither \\boxed{} nor ####
        ("\\boxed{1/0}", "1/0", 1.0),  # not a number: compared as strings
    ],
)
def test_math_verifier(response, truth, want):
    assert math_verifier(solution_str=response, ground_truth=truth) == want


def test_answer_extraction_and_numbers():
    assert extract_answer("a \\boxed{b} c \\boxed{d{e}}") == "d{e}"
    assert extract_answer("\\boxed{unclosed") is None
    assert extract_answer("#### 7\nmore text") == "7"
    assert to_number("1,234.50") == to_number("1234.5")
    assert to_number("-\\frac{1}{2}") == to_number("-0.5")
    assert to_number("12,34") is None and to_number("abc") is None


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reward_timeout_s": 1.0}, "reward_timeout_s=1.0 needs reward_workers >= 1"),
        ({"reward_workers": -1}, "reward_workers must be >= 0"),
        ({"reward_workers": 1, "reward_timeout_s": 0.0}, "reward_timeout_s must be > 0"),
        ({"reward_on_timeout": float("inf")}, "reward_on_timeout must be finite"),
        ({"reward_fn": "nope"}, "reward_fn must look like"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


def test_config_accepts_reward_forms():
    for spec in ("math", "exact_match", "pkg.mod:f", "rewards/my.py:f"):
        assert RolloutConfig(reward_fn=spec).reward_fn == spec
    cfg = RolloutConfig(reward_workers=2, reward_timeout_s=1.5, reward_on_timeout=-1.0)
    assert (cfg.reward_workers, cfg.reward_timeout_s, cfg.reward_on_timeout) == (2, 1.5, -1.0)


# ------------------------------------------------------------------ the process pool
def test_pool_timeouts_extras_and_errors(tmp_path):
    path = _write(
        tmp_path,
        """
        import time

        def slow(solution_str, ground_truth):
            if solution_str == "5":
                time.sleep(30)  # past reward_timeout_s: its worker is replaced
            if solution_str == "9":
                raise ValueError("no nines")
            return {"score": float(solution_str == ground_truth), "acc": 1.0}
        """,
    )
    scorer = _scorer(f"{path}:slow", reward_workers=1, reward_timeout_s=2.0, reward_on_timeout=-1.0)
    try:
        prompts = [_prompt(source=f"data.jsonl:{i}") for i in range(1, 5)]
        responses = [_ids("21"), _ids("5"), _ids("3"), _ids("21")]
        scores = scorer.score(prompts, responses, [0, 0, 1, 1])
        assert scores.rewards == [1.0, -1.0, 0.0, 1.0]
        assert scores.extras["timeouts"] == [0.0, 1.0, 0.0, 0.0]
        assert scores.extras["acc"][0] == 1.0 and math.isnan(scores.extras["acc"][1])
        with pytest.raises(RewardError, match="slow' failed on data.jsonl:2: ValueError: no nines"):
            scorer.score(prompts[:2], [_ids("1"), _ids("9")], [0, 0])
    finally:
        scorer.close()


def test_pool_rejects_an_unpicklable_reward():
    task = ReverseDigitsTask(3, seed=0)
    task.reward = lambda prompt, ids: 1.0  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="reward_workers=1: ReverseDigitsTask.reward cannot be"):
        RewardScorer(task, RolloutConfig(reward_workers=1))


# ------------------------------------------------------------------ once per replica, TP 2
def _tp2_body(rank: int, world_size: int, tmp: str) -> None:
    from megatron_grpo.megatron import ParallelConfig
    from megatron_grpo.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(tensor_model_parallel_size=2), seed=0)
    try:
        calls = Path(tmp) / "calls.txt"
        scorer = _scorer(f"{tmp}/counting.py:noisy")
        assert scorer.is_scorer == (rank == 0)
        prompts = [_prompt(source=f"data.parquet:{i}") for i in range(6)]
        responses = [_ids(str(i % 10)) for i in range(6)]
        scores = scorer.score(prompts, responses, list(range(6)))
        both: list = [None, None]
        dist.all_gather_object(both, (scores.rewards, scores.extras))
        assert both[0] == both[1]  # random rewards, yet the ranks agree: one rank scored
        assert set(both[0][1]) == {"noise"}
        dist.barrier()
        lines = calls.read_text().splitlines()
        assert len(lines) == 6, lines  # once per sample, not once per TP rank
        assert {line.split()[0] for line in lines} == {"0"}  # on TP rank 0

        # A failure on the scoring rank reaches its peer: both raise, neither waits.
        failing = _scorer(f"{tmp}/counting.py:fails")
        with pytest.raises(RewardError) as info:
            failing.score(prompts, responses, list(range(6)))
        message = str(info.value)
        assert "counting.py:fails' failed on data.parquet:4: KeyError" in message
        if rank == 1:
            assert "from this model replica's scoring rank" in message
        dist.barrier()  # both ranks got here
    finally:
        destroy_parallel()


def test_tp2_scores_once_and_ranks_agree(tmp_path):
    _write(
        tmp_path,
        f"""
        import os
        import random

        def noisy(solution_str, ground_truth):
            with open({str(tmp_path / "calls.txt")!r}, "a") as f:
                f.write(os.environ["RANK"] + " " + solution_str + "\\n")
            return {{"score": random.random(), "noise": random.random()}}

        def fails(solution_str, ground_truth):
            if solution_str == "4":
                raise KeyError("missing")
            return 1.0
        """,
        "counting.py",
    )
    run_distributed(_tp2_body, 2, str(tmp_path), timeout=120)
