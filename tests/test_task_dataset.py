"""``rollout.task: dataset``: JSONL / Parquet files in verl's layout (and the plain prompt/answer
JSONL), chat templates, stop ids from the tokenizer, overlong-prompt filtering, errors that name
file / row / column, a deterministic resumable order, and the config section."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest

from megatron_grpo.config import ConfigError
from megatron_grpo.errors import InputError
from megatron_grpo.rollout.config import DatasetConfig, RolloutConfig
from megatron_grpo.rollout.source import sampling_params
from megatron_grpo.rollout.tasks import DatasetTask, Prompt, build_task
from megatron_grpo.rollout.tasks.dataset import MAX_LISTED, exact_match
from megatron_grpo.train.config import load_train_config

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
needs_pyarrow = pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed"
)

WORDS = ["<unk>", "<eos>", "<im_end>", "user", "system", "assistant", ":", "end", "what", "is"]
WORDS += ["plus", "?", "the", "answer", "be", "brief", "hello", "x", "y"]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} end {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def _save_tokenizer(path, chat_template=None, generation_eos=None):
    vocab = {w: i for i, w in enumerate(WORDS + [str(d) for d in range(10)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Whitespace(), tokenizers.pre_tokenizers.Digits(True)]
    )
    tok.decoder = tokenizers.decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """A tokenizer with a chat template and generation_config.json eos ids [1, 2]."""
    return _save_tokenizer(tmp_path_factory.mktemp("chat_tok"), TEMPLATE, [1, 2])


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    """A tokenizer without a chat template or generation config."""
    return _save_tokenizer(tmp_path_factory.mktemp("plain_tok"))


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _parquet(path, rows):
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return str(path)


def _task(train, tok, max_prompt_length=64, seed=0, **kw):
    train = [train] if isinstance(train, str) else train
    cfg = DatasetConfig(train_files=train, tokenizer_dir=str(tok), **kw)
    return DatasetTask(cfg, max_prompt_length, seed)


def _chat_ids(tok_dir, messages, add_generation_prompt=True):
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    out = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


PLAIN = [{"prompt": f"what is {i} plus {i} ?", "answer": str(2 * i)} for i in range(5)]


def _verl_rows(n=4):
    return [
        {
            "data_source": "openai/gsm8k" if i % 2 else "lighteval/MATH",
            "prompt": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"what is {i} plus 1 ?"},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(n)
    ]


def _by_source(prompts):
    return sorted(prompts, key=lambda p: int(p.source.rpartition(":")[2]))


# ---- layouts ----------------------------------------------------------------------------------


def test_plain_prompt_answer_jsonl_keeps_working(tmp_path, plain_tok):
    path = _jsonl(tmp_path / "math.jsonl", PLAIN)
    task = _task(path, plain_tok)
    assert len(task) == 5 and task.stop_ids == ()
    prompts = _by_source(task.prompts(0, 5))
    for line, (row, p) in enumerate(zip(PLAIN, prompts, strict=True), 1):
        assert p.text == row["prompt"] and p.answer == row["answer"]  # no template: raw text
        assert list(p.ids) == task.tokenizer.encode(row["prompt"])
        assert (p.data_source, p.extra_info, p.source) == ("", None, f"{path}:{line}")
    p = prompts[3]
    right = task.tokenizer.encode("the answer is 6") + [task.tokenizer.eos_id]
    assert task.reward(p, right) == 1.0
    assert task.reward(p, task.tokenizer.encode("the answer is 7")) == 0.0


@pytest.mark.parametrize("fmt", ["jsonl", pytest.param("parquet", marks=needs_pyarrow)])
def test_verl_layout(tmp_path, chat_tok, fmt):
    rows = _verl_rows()
    path = (_jsonl if fmt == "jsonl" else _parquet)(tmp_path / f"train.{fmt}", rows)
    task = _task(path, chat_tok)
    prompts = _by_source(task.prompts(0, 4))
    for i, (row, p) in enumerate(zip(rows, prompts, strict=True)):
        assert p.source == f"{path}:{i + 1}"  # JSONL: the line; Parquet: the row (1-based)
        assert p.answer == str(i + 1) and p.data_source == row["data_source"]
        assert p.extra_info == row["extra_info"]
        assert list(p.ids) == _chat_ids(chat_tok, row["prompt"])
        assert p.text.endswith("assistant :")


@needs_pyarrow
def test_parquet_and_jsonl_read_the_same_prompts(tmp_path, chat_tok):
    rows = _verl_rows(6)
    a = _task(_jsonl(tmp_path / "t.jsonl", rows), chat_tok, seed=3).prompts(0, 12)
    b = _task(_parquet(tmp_path / "t.parquet", rows), chat_tok, seed=3).prompts(0, 12)
    strip = [(p.ids, p.text, p.answer, p.data_source, p.extra_info) for p in a]
    assert strip == [(p.ids, p.text, p.answer, p.data_source, p.extra_info) for p in b]


def test_ground_truth_of_any_json_type_becomes_its_json_text(tmp_path, plain_tok):
    rows = [
        {"prompt": "x", "reward_model": {"ground_truth": 42}},
        {"prompt": "y", "reward_model": {"ground_truth": ["a", 1]}, "answer": "ignored"},
    ]
    prompts = _by_source(_task(_jsonl(tmp_path / "g.jsonl", rows), plain_tok).prompts(0, 2))
    assert [p.answer for p in prompts] == ["42", '["a", 1]']


def test_exact_match_reward():
    assert exact_match("so it is 1,234.0", "1234") == 1.0
    assert exact_match("it is 12", "13") == 0.0
    assert exact_match(" hello ", "hello") == 1.0 and exact_match("hello x", "hello") == 0.0


def test_prompt_new_fields_have_defaults():
    p = Prompt((1, 2), "t", "a")
    assert (p.data_source, p.extra_info, p.source) == ("", None, "")
    q = Prompt((1, 2), "t", "a", extra_info={"k": 1})
    assert p == q and hash(p) == hash(q)  # extra_info is not compared or hashed


# ---- chat template ----------------------------------------------------------------------------


def test_message_list_prompt_equals_apply_chat_template(tmp_path, chat_tok):
    messages = [{"role": "user", "content": "what is 2 plus 2 ?"}]
    path = _jsonl(tmp_path / "c.jsonl", [{"prompt": messages, "answer": "4"}])
    p = _task(path, chat_tok).prompts(0, 1)[0]
    assert list(p.ids) == _chat_ids(chat_tok, messages)
    assert p.text == "user : what is 2 plus 2 ? end assistant :"
    # The tokenizer's own method behind the Tokenizer protocol gives the same ids.
    assert list(p.ids) == _task(path, chat_tok).tokenizer.encode_chat(messages)
    no_gen = _task(path, chat_tok, add_generation_prompt=False).prompts(0, 1)[0]
    assert list(no_gen.ids) == _chat_ids(chat_tok, messages, add_generation_prompt=False)


def test_chat_template_modes(tmp_path, chat_tok, plain_tok):
    text_path = _jsonl(tmp_path / "s.jsonl", [{"prompt": "hello", "answer": "x"}])
    msg_path = _jsonl(
        tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "hello"}], "answer": "x"}]
    )
    # auto with a template: a string prompt is one user message.
    auto = _task(text_path, chat_tok).prompts(0, 1)[0]
    assert list(auto.ids) == _chat_ids(chat_tok, [{"role": "user", "content": "hello"}])
    # false: raw text; a message list is an error naming the row and column.
    raw = _task(text_path, chat_tok, chat_template=False).prompts(0, 1)[0]
    assert raw.text == "hello"
    with pytest.raises(ValueError, match=r"m\.jsonl:1: column 'prompt': .*chat_template is false"):
        _task(msg_path, chat_tok, chat_template=False)
    # auto without a template: strings raw, message lists an error; true: an error.
    assert _task(text_path, plain_tok).prompts(0, 1)[0].text == "hello"
    with pytest.raises(ValueError, match=r"m\.jsonl:1: column 'prompt': .*has none"):
        _task(msg_path, plain_tok)
    with pytest.raises(ValueError, match="chat_template is true but the tokenizer"):
        _task(text_path, plain_tok, chat_template=True)


def test_a_failing_chat_template_names_the_row(tmp_path):
    tok = _save_tokenizer(
        tmp_path / "tok", "{% if messages[0]['role'] != 'user' %}{{ raise_exception('no') }}"
        "{% endif %}{{ messages[0]['content'] }}",
    )  # fmt: skip
    rows = [{"prompt": "hello", "answer": "x"}, {"prompt": [{"role": "x", "content": "y"}],
            "answer": "y"}]  # fmt: skip
    with pytest.raises(ValueError, match=r"t\.jsonl:2: column 'prompt': the chat template failed"):
        _task(_jsonl(tmp_path / "t.jsonl", rows), tok)


def test_stop_ids_come_from_generation_config(tmp_path, chat_tok):
    task = _task(_jsonl(tmp_path / "a.jsonl", PLAIN), chat_tok)
    assert task.tokenizer.eos_id == 1 and task.stop_ids == (2,)  # [1, 2] minus eos
    cfg = load_train_config(None, ["model.vocab_size=32", "rollout.sampling.stop_ids=[5, 2]"])
    params = sampling_params(
        cfg.rollout, cfg.model.vocab_size, task.tokenizer.eos_id, task.stop_ids
    )
    assert params.stop_ids == (5, 2) and params.stops == {1, 2, 5}
    one = _save_tokenizer(tmp_path / "one", generation_eos=2)  # an int works too
    assert _task(_jsonl(tmp_path / "b.jsonl", PLAIN), one).stop_ids == (2,)
    bad = _save_tokenizer(tmp_path / "bad", generation_eos="eos")
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be"):
        _task(_jsonl(tmp_path / "c.jsonl", PLAIN), bad)


# ---- overlong prompts -------------------------------------------------------------------------


def _long_rows(n, long_rows):
    return [
        {"prompt": "what is 1 plus 1 ?" * (5 if i in long_rows else 1), "answer": "2"}
        for i in range(n)
    ]


def test_overlong_prompts_are_dropped_and_reported_once(tmp_path, plain_tok, capsys):
    path = _jsonl(tmp_path / "train.jsonl", _long_rows(8, {2, 5}))
    val = _jsonl(tmp_path / "val.jsonl", _long_rows(3, {0}))
    cfg = DatasetConfig(train_files=[path], val_files=[val], tokenizer_dir=str(plain_tok))
    task = DatasetTask(cfg, max_prompt_length=8, seed=0)
    assert len(task) == 6 and len(task.val_prompts()) == 2
    assert all(len(p.ids) <= 8 for p in task.prompts(0, 12))
    rows = {p.source for p in task.prompts(0, 6)}
    assert rows == {f"{path}:{line}" for line in (1, 2, 4, 5, 7, 8)}
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    assert "dropped 2 of 8 train, 1 of 3 val prompts over rollout.max_prompt_length=8" in out[0]
    assert f"{path} rows 3, 6; {val} row 1" in out[0] and "more" not in out[0]


def test_many_overlong_prompts_are_listed_up_to_a_limit(tmp_path, plain_tok, capsys):
    path = _jsonl(tmp_path / "t.jsonl", _long_rows(20, set(range(15))))
    _task(path, plain_tok, max_prompt_length=8)
    line = capsys.readouterr().out.strip()
    assert "dropped 15 of 20 train" in line
    assert f"rows {', '.join(str(i) for i in range(1, MAX_LISTED + 1))} and 5 more" in line


def test_overlong_prompt_is_a_startup_error_without_the_filter(tmp_path, plain_tok):
    path = _jsonl(tmp_path / "t.jsonl", _long_rows(4, {2}))
    with pytest.raises(ValueError, match=r"t\.jsonl:3: column 'prompt': the prompt has 30 tokens"):
        _task(path, plain_tok, max_prompt_length=8, filter_overlong_prompts=False)
    with pytest.raises(ValueError, match="all 4 prompts are longer"):
        _task(_jsonl(tmp_path / "all.jsonl", _long_rows(4, {0, 1, 2, 3})), plain_tok, 8)


# ---- malformed input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "x", "answer": "1"}', "", '{"prompt": "x", '], r":3: invalid JSON at column"),
        (['{"question": "x", "answer": "1"}'], r":1: no column 'prompt' \(rollout.dataset"),
        (['{"prompt": 7, "answer": "1"}'], r":1: column 'prompt': expected a string or a list"),
        (['{"prompt": null, "answer": "1"}'], r":1: column 'prompt' is null"),
        (['{"prompt": "", "answer": "1"}'], r":1: column 'prompt' is an empty string"),
        (['{"prompt": [], "answer": "1"}'], r":1: column 'prompt' is an empty message list"),
        (['{"prompt": ["hi"], "answer": "1"}'], r":1: column 'prompt\[0\]': expected a"),
        (['{"prompt": [{"role": "user"}], "answer": "1"}'], r":1: column 'prompt\[0\].content'"),
        (['{"prompt": "x"}'], r":1: no ground truth: expected column 'reward_model.ground_truth'"),
        (['{"prompt": "x", "answer": null}'], r":1: column 'answer' is null"),
        (['{"prompt": "x", "reward_model": "1"}'], r":1: column 'reward_model': expected an"),
        (['{"prompt": "x", "reward_model": {"style": "rule"}}'], r"'reward_model.ground_truth'"),
        (['{"prompt": "x", "answer": "1", "data_source": 3}'], r":1: column 'data_source'"),
        (['{"prompt": "x", "answer": "1", "extra_info": [1]}'], r":1: column 'extra_info'"),
        (["[1, 2]"], r":1: expected a JSON object, got list"),
        ([], r"rollout.dataset.train_files\[0\]: .* has no rows"),
    ],
)
def test_bad_jsonl_rows_name_file_row_and_column(tmp_path, plain_tok, lines, message):
    path = _jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message) as e:
        _task(path, plain_tok)
    assert "\n" not in str(e.value)
    if ":1:" in message or ":3:" in message:
        assert str(e.value).startswith(str(path))


def test_non_utf8_line_names_the_line(tmp_path, plain_tok):
    path = tmp_path / "b.jsonl"
    path.write_bytes(b'{"prompt": "x", "answer": "1"}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl:2: not UTF-8 text"):
        _task(str(path), plain_tok)


@needs_pyarrow
def test_bad_parquet_rows_name_file_row_and_column(tmp_path, plain_tok):
    rows = [{"prompt": "x", "answer": "1"}, {"prompt": None, "answer": "2"}]
    path = _parquet(tmp_path / "b.parquet", rows)
    with pytest.raises(ValueError, match=r"b\.parquet:2: column 'prompt' is null"):
        _task(path, plain_tok)
    path = _parquet(tmp_path / "q.parquet", [{"question": "x", "answer": "1"}])
    with pytest.raises(ValueError, match=r"q\.parquet:1: no column 'prompt' .*columns: question"):
        _task(path, plain_tok)
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet: cannot read as Parquet"):
        _task(str(broken), plain_tok)


def test_prompt_key_picks_the_column(tmp_path, plain_tok):
    path = _jsonl(tmp_path / "k.jsonl", [{"question": "hello", "answer": "x"}])
    assert _task(path, plain_tok, prompt_key="question").prompts(0, 1)[0].text == "hello"


def test_missing_files_name_the_field(tmp_path, plain_tok):
    good = _jsonl(tmp_path / "good.jsonl", PLAIN)
    with pytest.raises(ValueError, match=r"rollout.dataset.train_files\[1\]: no such file"):
        _task([good, str(tmp_path / "nope.jsonl")], plain_tok)
    with pytest.raises(ValueError, match=r"rollout.dataset.val_files\[0\]: no such file"):
        cfg = DatasetConfig([good], [str(tmp_path / "v.parquet")], tokenizer_dir=str(plain_tok))
        DatasetTask(cfg, 64, 0)
    with pytest.raises(ValueError, match="rollout.dataset.tokenizer_dir .* is not a directory"):
        _task(good, tmp_path / "no_tok")


def test_parquet_without_pyarrow_names_the_package(tmp_path, plain_tok, monkeypatch):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"train_files\[0\]: .*needs the 'pyarrow' package"):
        _task(str(path), plain_tok)


# ---- order ------------------------------------------------------------------------------------


def test_order_is_a_seeded_permutation_per_epoch_and_prompts_are_pure(tmp_path, plain_tok):
    rows = [{"prompt": f"what is {i} ?", "answer": str(i)} for i in range(7)]
    path = _jsonl(tmp_path / "o.jsonl", rows)
    task = _task(path, plain_tok, seed=11)
    run = task.prompts(0, 21)  # three epochs
    for epoch in range(3):
        assert sorted(p.answer for p in run[7 * epoch : 7 * (epoch + 1)]) == sorted(
            r["answer"] for r in rows
        )
    assert run[:7] != run[7:14]  # a fresh permutation per epoch
    # A resumed run (a fresh task) draws what the uninterrupted one did, from any index.
    for start, n in [(0, 3), (5, 4), (13, 8), (20, 1)]:
        assert _task(path, plain_tok, seed=11).prompts(start, n) == run[start : start + n]
    assert task.prompts(13, 8) == run[13:21] and task.prompts(0, 3) == run[:3]
    assert _task(path, plain_tok, seed=12).prompts(0, 7) != run[:7]


def test_val_prompts_in_file_order(tmp_path, plain_tok):
    train = _jsonl(tmp_path / "t.jsonl", PLAIN)
    v1 = _jsonl(tmp_path / "v1.jsonl", PLAIN[:2])
    v2 = _jsonl(tmp_path / "v2.jsonl", PLAIN[2:3])
    cfg = DatasetConfig([train], [v1, v2], tokenizer_dir=str(plain_tok))
    val = DatasetTask(cfg, 64, 0).val_prompts()
    assert [p.source for p in val] == [f"{v1}:1", f"{v1}:2", f"{v2}:1"]
    assert _task(train, plain_tok).val_prompts() == []


# ---- config -----------------------------------------------------------------------------------


def test_recipe_with_task_dataset_loads_and_builds(tmp_path, chat_tok):
    train = _jsonl(tmp_path / "train.jsonl", _verl_rows())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "rollout:\n  task: dataset\n  max_prompt_length: 64\n  max_response_length: 8\n"
        f"  dataset:\n    train_files: [{train}]\n    tokenizer_dir: {chat_tok}\n"
        "    chat_template: false\n"
    )
    sets = ["rollout.dataset.chat_template=auto", "rollout.dataset.add_generation_prompt=false"]
    cfg = load_train_config(recipe, [*sets, "model.vocab_size=32"])
    d = cfg.rollout.dataset
    assert (cfg.rollout.task, d.train_files, d.chat_template, d.add_generation_prompt) == (
        "dataset", [train], "auto", False,
    )  # fmt: skip
    assert d.prompt_key == "prompt" and d.filter_overlong_prompts and d.val_files == []
    task = build_task(cfg.rollout, cfg.training.seed)
    assert isinstance(task, DatasetTask) and not task.prompts(0, 1)[0].text.endswith(":")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.dataset.train_file=[a.jsonl]"], "did you mean 'train_files'"),
        (["rollout.dataset.promt_key=q"], "did you mean 'prompt_key'"),
        (["rollout.dataset.filter_overlong=false"], "did you mean 'filter_overlong_prompts'"),
        (["rollout.dataset.train_files=[a.csv]"], r"train_files\[0\]: 'a.csv' must end in"),
        (["rollout.dataset.chat_template=maybe"], "chat_template must be auto, true or false"),
        (["rollout.dataset.prompt_key="], "prompt_key must not be empty"),
        (["rollout.task=dataset"], "dataset.train_files is required when task is 'dataset'"),
        (["rollout.task=dataset", "rollout.dataset.train_files=[a.jsonl]"], "tokenizer_dir is"),
    ],
)
def test_dataset_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, overrides)


def test_unknown_key_in_the_recipe_section(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  dataset:\n    tokenizer: x\n")
    with pytest.raises(ConfigError, match=r"'rollout.dataset.tokenizer'; did you mean"):
        load_train_config(recipe)


def test_default_rollout_config_is_unchanged():
    r = RolloutConfig()
    assert r.task == "reverse_digits" and r.dataset == DatasetConfig()


# ---- issue 39: silent data problems are errors (or one warning) -----------------------------


def test_mostly_unknown_tokens_empty_content_and_blank_prompts_name_file_row(tmp_path, chat_tok):
    ok = {"prompt": "what is 1 plus 2 ?", "answer": "3"}
    cases = [
        ({"prompt": "qué es uno más dos ?", "answer": "3"}, "of the prompt's"),
        ({"prompt": [{"role": "user", "content": ""}], "answer": "3"}, "[0].content' is empty"),
        ({"prompt": "   ", "answer": "3"}, "column 'prompt' is empty (whitespace only)"),
    ]
    for i, (row, what) in enumerate(cases):
        path = _jsonl(tmp_path / f"d{i}.jsonl", [ok, row])
        with pytest.raises(InputError, match=re.escape(what)) as e:
            _task([path], chat_tok)
        assert str(e.value).startswith(f"{path}:2: "), str(e.value)
        if i == 0:
            assert f"unknown token '<unk>' of the tokenizer in '{chat_tok}'" in str(e.value)


def test_fewer_rows_than_num_prompts_is_one_warning(tmp_path, chat_tok):
    from megatron_grpo.train.check import repeat_warning
    from megatron_grpo.train.config import load_train_config

    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "what is 1 plus 2 ?", "answer": "3"}] * 3)
    cfg = load_train_config("recipes/tiny.yaml", ["rollout.num_prompts=8"])
    line = repeat_warning(cfg, _task([path], chat_tok))
    assert line is not None and line.startswith("warning: rollout.num_prompts=8 but the training")
    assert "has 3 prompts" in line and repeat_warning(cfg, _task([path] * 3, chat_tok)) is None
