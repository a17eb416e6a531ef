"""Tasks: the toy tokenizer and reward, the local-JSONL math task with a local HF tokenizer, and
reward plug-ins by import path."""

from __future__ import annotations

import json
import sys
import types

import pytest

from megatron_grpo.rollout.config import RolloutConfig
from megatron_grpo.rollout.tasks import (
    DigitTokenizer,
    MathTask,
    ReverseDigitsTask,
    build_task,
    load_reward_fn,
)
from megatron_grpo.rollout.tasks.math import last_number


def test_digit_tokenizer_round_trip_and_errors():
    tok = DigitTokenizer()
    ids = tok.encode("<bos>907=<eos>")
    assert ids == [11, 9, 0, 7, 10, 12]
    assert tok.decode(ids) == "<bos>907=<eos>"
    with pytest.raises(ValueError, match="cannot encode 'x'"):
        tok.encode("1x")
    with pytest.raises(ValueError, match="outside the DigitTokenizer vocab"):
        tok.decode([13])


def test_reverse_digits_prompts_are_a_function_of_the_index():
    task = ReverseDigitsTask(num_digits=3, seed=5)
    a = task.prompts(10, 4)
    assert a == task.prompts(10, 4) == ReverseDigitsTask(3, 5).prompts(10, 4)
    assert a[1:] == task.prompts(11, 3)
    assert a != ReverseDigitsTask(3, 6).prompts(10, 4)
    for p in a:
        digits = p.text[len("<bos>") : -1]
        assert p.answer == digits[::-1] and len(p.ids) == 5


def test_reverse_digits_reward_counts_matching_positions():
    task = ReverseDigitsTask(num_digits=3, seed=0)
    prompt = task.prompts(0, 1)[0]
    target = task.tokenizer.encode(prompt.answer) + [task.tokenizer.eos_id]
    assert task.reward(prompt, target) == 1.0
    assert task.reward(prompt, target[:2] + [10, 10]) == 0.5
    assert task.reward(prompt, target[:1]) == 0.25  # cut short: missing positions score 0
    wrong = [(t + 1) % 10 for t in target[:3]] + [10]
    assert task.reward(prompt, wrong) == 0.0


@pytest.fixture
def local_tokenizer_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<unk>", "<eos>", "what", "is", "plus", "?", "the", "answer"]
    vocab = {w: i for i, w in enumerate(words + [str(d) for d in range(10)])}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Whitespace(), tokenizers.pre_tokenizers.Digits(True)]
    )
    tok.decoder = tokenizers.decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_math_task_reads_jsonl_and_scores_the_last_number(tmp_path, local_tokenizer_dir):
    data = tmp_path / "math.jsonl"
    rows = [{"prompt": f"what is {i} plus {i} ?", "answer": str(2 * i)} for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = MathTask(str(data), str(local_tokenizer_dir), "{prompt} the answer is", seed=3)
    assert task.tokenizer.vocab_size == 18 and task.tokenizer.eos_id == 1
    epoch = task.prompts(0, 5)
    assert sorted(p.answer for p in epoch) == sorted(r["answer"] for r in rows)
    assert task.prompts(5, 5) != epoch  # a fresh permutation per epoch ...
    assert sorted(p.answer for p in task.prompts(5, 5)) == sorted(p.answer for p in epoch)
    prompt = epoch[0]
    assert prompt.text.endswith("the answer is")
    right = task.tokenizer.encode(f"the answer is {prompt.answer}") + [1]
    wrong = task.tokenizer.encode("the answer is 97")
    assert task.reward(prompt, right) == 1.0 and task.reward(prompt, wrong) == 0.0


def test_math_task_errors_name_the_input(tmp_path, local_tokenizer_dir):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: row has no 'answer'"):
        MathTask(str(data), str(local_tokenizer_dir), "{prompt}", seed=0)
    data.write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="tokenizer_dir .* is not a directory"):
        MathTask(str(data), str(tmp_path / "nope"), "{prompt}", seed=0)
    with pytest.raises(ValueError, match="prompt_template must contain"):
        MathTask(str(data), str(local_tokenizer_dir), "no placeholder", seed=0)


def test_last_number():
    assert last_number("so 3 + 4 = 7.") == 7.0
    assert last_number("total: 1,234.5 dollars") == 1234.5
    assert last_number("-12") == -12.0
    assert last_number("no digits") is None


@pytest.fixture
def plugin_module(monkeypatch):
    module = types.ModuleType("my_rewards")
    module.exact = lambda prompt, response, answer: float(response == answer)
    module.not_callable = 3
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    return module


def test_reward_plugin_replaces_the_task_reward(plugin_module):
    cfg = RolloutConfig(reward_fn="my_rewards:exact", max_prompt_length=8, max_response_length=4)
    task = build_task(cfg, seed=0)
    prompt = task.prompts(0, 1)[0]
    right = task.tokenizer.encode(prompt.answer) + [task.tokenizer.eos_id]  # eos is stripped
    assert task.reward(prompt, right) == 1.0
    assert task.reward(prompt, right[:2]) == 0.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("my_rewards:missing", "has no callable 'missing'"),
        ("my_rewards:not_callable", "has no callable 'not_callable'"),
        ("my_rewards:", "must look like"),
    ],
)
def test_reward_plugin_errors(plugin_module, spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)
