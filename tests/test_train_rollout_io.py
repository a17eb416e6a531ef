"""Rollout files: JSONL / Parquet round trips, group-wise reading, and clear errors."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.files import RolloutFileSource, read_rollouts, write_rollouts

HAVE_PYARROW = importlib.util.find_spec("pyarrow") is not None


def _batch(with_logprobs: bool = True, with_rewards: bool = True) -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=[[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]],
        response_ids=[[7, 8], [9], [10, 11, 12], [13]],
        group_ids=[0, 0, 5, 5],
        rollout_logprobs=[[-0.5, -1.25], [-2.0], [-0.1, -0.2, -1e-7], [-3.5]]
        if with_logprobs
        else None,
        rewards=[1.0, 0.0, 0.25, -1.5] if with_rewards else None,
    )


FORMATS = [
    "jsonl",
    pytest.param(
        "parquet", marks=pytest.mark.skipif(not HAVE_PYARROW, reason="pyarrow not installed")
    ),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("full", [True, False], ids=["all_columns", "ids_only"])
def test_round_trip_is_exact(tmp_path, fmt, full):
    batch = _batch(with_logprobs=full, with_rewards=full)
    path = tmp_path / f"r.{fmt}"
    write_rollouts(batch, path)
    assert read_rollouts(path) == batch
    assert not list(tmp_path.glob("*.tmp"))


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    # None in sys.modules makes `import pyarrow` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pyarrow"):
        write_rollouts(_batch(), tmp_path / "r.parquet")


def test_file_source_takes_whole_groups_in_order_and_renumbers(tmp_path):
    write_rollouts(_batch(), tmp_path / "a_step1.jsonl")
    second = _batch()
    second.group_ids = [3, 3, 3, 9]
    write_rollouts(second, tmp_path / "b_step2.jsonl")
    source = RolloutFileSource(tmp_path)
    assert len(source) == 4  # groups 0, 5 of file a; 3, 9 of file b
    got = source.take(1, 2)
    assert got.group_ids == [0, 0, 1, 1, 1]
    assert got.prompt_ids == [[4, 5], [4, 5], [1, 2, 3], [1, 2, 3], [4, 5]]
    assert got.rewards == [0.25, -1.5, 1.0, 0.0, 0.25]
    with pytest.raises(ValueError, match="4 groups"):
        source.take(3, 2)


def test_nonfinite_logprobs_survive_jsonl(tmp_path):
    # Users' files may carry NaN log-probs; the trainer must see them to skip and report.
    batch = _batch()
    batch.rollout_logprobs[1] = [math.nan]
    write_rollouts(batch, tmp_path / "r.jsonl")
    assert math.isnan(read_rollouts(tmp_path / "r.jsonl").rollout_logprobs[1][0])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt_ids": [1], "response_ids": [2]}], "no 'group_id'"),
        (
            [
                {"prompt_ids": [1], "response_ids": [2], "group_id": 0, "reward": 1.0},
                {"prompt_ids": [1], "response_ids": [2], "group_id": 0},
            ],
            "'reward' is present in some rows but not all",
        ),
        (
            [{"prompt_ids": [1], "response_ids": [2, 3], "group_id": 0, "rollout_logprobs": [0]}],
            "bad.jsonl:1: rollout_logprobs must be a list of one number per response token",
        ),
        ([{"prompt_ids": [1], "response_ids": [], "group_id": 0}], "must be a non-empty list"),
        (
            [{"prompt_ids": [1], "response_ids": [2], "group_id": 0, "reward": float("inf")}],
            "bad.jsonl:1: reward = inf is not a finite number",
        ),
    ],
)
def test_bad_rows_are_errors_naming_the_column(tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=message):
        read_rollouts(path)


def test_paths_are_checked(tmp_path):
    with pytest.raises(ValueError, match="must end in one of"):
        write_rollouts(_batch(), tmp_path / "r.csv")
    with pytest.raises(ValueError, match="does not exist"):
        RolloutFileSource(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="holds no .jsonl/.parquet"):
        RolloutFileSource(tmp_path)
    (tmp_path / "broken.jsonl").write_text("{not json}\n")
    with pytest.raises(ValueError, match="broken.jsonl:1: invalid JSON"):
        read_rollouts(tmp_path / "broken.jsonl")


def _line(**kw) -> str:
    row = {"prompt_ids": [1, 2], "response_ids": [3, 4], "group_id": 0, "reward": 1.0}
    return json.dumps({**row, **kw}) + "\n"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"response_ids": [3, -1]}, "r.jsonl:3: response_ids\\[1\\] = -1 is not a token id"),
        ({"prompt_ids": [1, "7"]}, "r.jsonl:3: prompt_ids\\[1\\] = '7' is not a token id"),
        ({"reward": "high"}, "r.jsonl:3: reward = 'high' is not a finite number"),
        ({"reward": True}, "r.jsonl:3: reward = True is not a finite number"),
        ({"rollout_logprobs": [-1.0, "x"]}, "r.jsonl:3: rollout_logprobs\\[1\\] = 'x'"),
    ],
)
def test_bad_values_name_file_line_and_field(tmp_path, bad, message):
    path = tmp_path / "r.jsonl"
    path.write_text(_line() + "\n" + _line(**bad))  # a blank line 2: line numbers are kept
    with pytest.raises(ValueError, match=message):
        RolloutFileSource(path)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"response_ids": [3, 999]}, "r.jsonl:2: response_ids\\[1\\] = 999 is not below "
         "model.vocab_size = 13"),
        ({"prompt_ids": list(range(10))}, "r.jsonl:2: prompt_ids \\+ response_ids = 10 \\+ 2 "
         "tokens exceed model.max_sequence_length = 11"),
    ],
)  # fmt: skip
def test_rollouts_are_checked_against_the_model(tmp_path, bad, message):
    path = tmp_path / "r.jsonl"
    path.write_text(_line() + _line(**bad))
    with pytest.raises(ValueError, match=message):
        RolloutFileSource(path).check_against_model(vocab_size=13, max_sequence_length=11)
    path.write_text(_line() + _line())
    RolloutFileSource(path).check_against_model(vocab_size=5, max_sequence_length=4)


def test_file_rollout_source_checks_rewards_and_takes_each_ranks_groups(tmp_path):
    from megatron_grpo.rollout import SamplingParams
    from megatron_grpo.rollout.source import FileRollouts, sampling_params
    from megatron_grpo.train.config import TrainConfig

    write_rollouts(_batch(), tmp_path / "a.jsonl")
    write_rollouts(_batch(with_rewards=False), tmp_path / "b" / "r.jsonl")
    cfg = TrainConfig()
    cfg.rollout.num_prompts, cfg.training.steps = 2, 1
    cfg.rollout.input_path = str(tmp_path / "a.jsonl")
    ctx = cfg.rollout_context()
    rank1 = FileRollouts(cfg.rollout, ctx, dp_rank=1, dp_size=2).next(0)  # the second group
    assert rank1.prompt_ids == [[4, 5], [4, 5]] and rank1.rewards == [0.25, -1.5]
    assert not FileRollouts.generated and FileRollouts(cfg.rollout, ctx, 0, 2).metrics() == {}
    cfg.rollout.input_path = str(tmp_path / "b")
    with pytest.raises(ValueError, match="r.jsonl:1: .* must carry a 'reward' column"):
        FileRollouts(cfg.rollout, ctx, 0, 1)
    cfg.rollout.sampling = SamplingParams(stop_ids=(20,))
    with pytest.raises(ValueError, match="rollout.sampling.stop_ids 20 is outside the vocabulary"):
        sampling_params(cfg.rollout, cfg.model.vocab_size, eos_id=12)
