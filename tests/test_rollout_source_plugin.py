"""``rollout.source``: generate / files / a user class ("module:Class" or "path/file.py:Class")
implementing the RolloutSource protocol, plugged in without touching the loop. The example
source of docs/trainer.md and a source of fixed token sequences each train for 2 steps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_grpo.config import ConfigError
from megatron_grpo.rollout.batch import RolloutBatch
from megatron_grpo.rollout.build import source_class
from megatron_grpo.rollout.source import GeneratedRollouts
from megatron_grpo.train.config import load_train_config
from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny.yaml"
DOC = ROOT / "docs" / "trainer.md"


class FixedRollouts:
    """The same token sequences every step, with fixed rewards: per DP rank ``num_prompts / DP``
    groups of ``group_size`` samples (toy vocabulary: digits, 10 '=', 11 <bos>, 12 <eos>)."""

    generated = False

    def __init__(self, cfg, task, model, dp_rank, dp_size):
        self.cfg, self.calls = cfg, 0
        self.per_rank = cfg.rollout.num_prompts // dp_size
        self.first = dp_rank * self.per_rank

    def next(self, step):
        self.calls += 1
        g = self.cfg.rollout.group_size
        prompts, responses, groups, rewards = [], [], [], []
        for k in range(self.per_rank):
            d = (self.first + k) % 10
            for i in range(g):
                prompts.append([11, d, (d + 1) % 10, 10])
                responses.append([(d + 1) % 10, d, 12] if i % 2 == 0 else [d, 12])
                groups.append(step * self.cfg.rollout.num_prompts + self.first + k)
                rewards.append(1.0 if i % 2 == 0 else 0.0)
        return RolloutBatch(prompts, responses, groups, rewards=rewards)

    def metrics(self):
        return {"rollout/fixed_calls": float(self.calls)}


class NotASource:
    def next(self, step):  # no metrics()
        return None


def _doc_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if b.startswith("# my_sources.py")]
    assert len(found) == 1, "docs/trainer.md lost its example rollout source"
    return found[0]


# ---- config -------------------------------------------------------------------------------------


def test_source_defaults_from_input_path():
    assert load_train_config(RECIPE).rollout.source == "generate"
    cfg = load_train_config(RECIPE, ["rollout.input_path=runs/x"])
    assert cfg.rollout.source == "files"
    cfg = load_train_config(RECIPE, ["rollout.source=files", "rollout.input_path=runs/x"])
    assert cfg.rollout.source == "files"
    assert load_train_config(RECIPE, ["rollout.source=pkg.mod:Cls"]).rollout.source == "pkg.mod:Cls"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.source=generate", "rollout.input_path=r"], "source: generate contradicts input"),
        (["rollout.source=files"], "source: files needs input_path"),
        (
            ["rollout.source=a.py:C", "rollout.input_path=r"],
            "source: a.py:C contradicts input_path",
        ),
        (["rollout.source=vllm"], "source must be generate, files, 'pkg.module:Class'"),
    ],
)
def test_source_contradictions_name_both_fields(overrides, message):
    with pytest.raises(ConfigError, match=f"rollout(: |\\.){message}"):
        load_train_config(RECIPE, overrides)


def test_source_class_forms_and_errors(tmp_path):
    assert source_class("generate") is GeneratedRollouts
    assert source_class("tests.test_rollout_source_plugin:FixedRollouts") is FixedRollouts
    path = tmp_path / "my_sources.py"
    path.write_text(_doc_example())
    assert source_class(f"{path}:SampleAndScore").__name__ == "SampleAndScore"
    errors = {
        f"{tmp_path}/none.py:X": "rollout.source: no file",
        "no_such_module_xyz:X": "cannot import module 'no_such_module_xyz'",
        f"{path}:Missing": "has no class 'Missing'",
        "tests.test_rollout_source_plugin:NotASource": "NotASource has no metrics method",
    }
    for spec, message in errors.items():
        with pytest.raises(ValueError, match=message):
            source_class(spec)


# ---- two steps through the trainer --------------------------------------------------------------


def _body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.train.trainer import Trainer

    base = [
        "parallel.tensor_model_parallel_size=1", "rollout.num_prompts=4", "rollout.group_size=2",
        "training.steps=2", "training.mini_batches_per_step=1", "training.micro_batch_size=8",
        "checkpoint.dir=null", "logging.progress_bar=false",
    ]  # fmt: skip
    # The fixed source: its batches are trained on as they are (rewards, groups, metrics).
    fixed = "tests.test_rollout_source_plugin:FixedRollouts"
    cfg = load_train_config(RECIPE, base + [f"rollout.source={fixed}", f"logging.dir={tmp / 'a'}"])
    trainer = Trainer(cfg)
    assert isinstance(trainer.source, FixedRollouts)
    history = trainer.train()
    assert [h["reward/mean"] for h in history] == [0.5, 0.5]
    assert [h["rollout/fixed_calls"] for h in history] == [1.0, 2.0]
    assert all(h["optim/skipped_steps"] == 0.0 and h["optim/grad_norm"] > 0 for h in history)
    assert "perf/generation_tokens_per_s" not in history[0]  # generated = False
    lines = (tmp / "a" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]

    # The documented example, loaded from its file: it samples with the policy.
    example = f"{tmp / 'my_sources.py'}:SampleAndScore"
    cfg = load_train_config(RECIPE, base + [f"rollout.source={example}", f"logging.dir={tmp}/b"])
    trainer = Trainer(cfg)
    assert type(trainer.source).__name__ == "SampleAndScore"
    history = trainer.train()
    assert len(history) == 2
    for h in history:
        assert 0.0 <= h["reward/mean"] <= 1.0 and h["rollout/response_tokens"] > 0
        assert h["perf/generation_tokens_per_s"] > 0 and "mismatch/k3" in h  # logprobs came


@pytest.mark.slow
def test_custom_sources_train_two_steps(tmp_path):
    (tmp_path / "my_sources.py").write_text(_doc_example())
    run_distributed(_body, 1, tmp_path, timeout=300)
