"""docs/byo_task.md runs as written: a tiny Qwen3-like model and a chat tokenizer built here
(no downloads), converted with the project's converter, the page's data script and reward file,
and the page's torchrun command on ``recipes/byo_task.yaml`` (TP 2, gloo) with ``--set``
overrides pointing at ``tmp_path``; ``metrics.jsonl`` holds eval/ metrics at step 0, at the
interval and at the end, and the reward metrics of every step."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "byo_task.md"
RECIPE = ROOT / "recipes" / "byo_task.yaml"

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["<unk>", "system", "user", "assistant", "what", "is", "plus", "minus", "?"]
# Qwen's chat layout (<|im_start|>role\ncontent<|im_end|>\n), without its tool / thinking parts.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_HF = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
           tie_word_embeddings=False)  # fmt: skip


def save_chat_tokenizer(path: Path):
    """A word-level tokenizer (22 tokens: Qwen's three special tokens, the toy task's words,
    the digits) with a Qwen-style chat template; eos ``<|im_end|>``."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + [str(d) for d in range(10)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Whitespace(), tokenizers.pre_tokenizers.Digits(True)]
    )
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return fast


def save_tiny_qwen(path: Path) -> Path:
    """A random 2-layer Qwen3 with the tokenizer of :func:`save_chat_tokenizer` next to it and
    Qwen's two stop ids in ``generation_config.json``."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    tok = save_chat_tokenizer(path)
    cfg = CONFIG_MAPPING["qwen3"](vocab_size=len(tok), eos_token_id=tok.eos_token_id, **_HF)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(["<|im_end|>", SPECIAL[0]])
    model.save_pretrained(path)
    return path


def _block(lang: str, first_line: str) -> str:
    """The page's ``lang`` code block whose first line starts with ``first_line``."""
    blocks = re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, f"docs/byo_task.md: no single {lang} block starting {first_line!r}"
    return found[0]


def _command(prefix: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    lines = [line for block in blocks for line in block.split("\n")]
    found = [ln for ln in lines if ln.startswith(prefix)]
    assert len(found) == 1, f"docs/byo_task.md: no single command starting {prefix!r}"
    return shlex.split(found[0].split("#")[0])


def test_doc_is_linked_and_names_the_recipe():
    assert "docs/byo_task.md" in (ROOT / "README.md").read_text()
    assert "byo_task.md" in (ROOT / "docs" / "trainer.md").read_text()
    cmd = _command("torchrun")
    assert cmd[cmd.index("--config") + 1] == "recipes/byo_task.yaml"
    convert = _command("python tools/convert_checkpoint.py hf-to-mcore")
    assert convert[convert.index("--out") + 1] == "ckpt/byo"


@pytest.mark.slow
def test_byo_task_page_runs(tmp_path):
    pytest.importorskip("pyarrow")
    from megatron_grpo.convert import hf_to_mcore

    # 1. the model: built here, converted as the page's command does (ckpt/byo, hf/ assets)
    ckpt = hf_to_mcore(save_tiny_qwen(tmp_path / "hf"), tmp_path / "ckpt" / "byo")
    assert (ckpt / "hf" / "generation_config.json").is_file()
    # 2. the data script and 3. the reward file, as the page has them
    script = tmp_path / "make_byo_data.py"
    script.write_text(_block("python", "# make_byo_data.py"))
    subprocess.run([sys.executable, str(script)], cwd=tmp_path, check=True, timeout=120)
    reward = tmp_path / "rewards" / "byo_reward.py"
    reward.parent.mkdir()
    reward.write_text(_block("python", "# rewards/byo_reward.py"))
    # 4. the page's training command, its paths pointed at tmp_path
    data, run = tmp_path / "data" / "byo", tmp_path / "runs"
    overrides = [
        f"rollout.dataset.train_files=[{data / 'train.parquet'}]",
        f"rollout.dataset.val_files=[{data / 'val.parquet'}]",
        f"rollout.dataset.tokenizer_dir={ckpt / 'hf'}",
        f"rollout.reward_fn={reward}:compute_score",
        f"checkpoint.load={ckpt}", "checkpoint.dir=null", f"logging.dir={run}",
        "logging.progress_bar=false", "training.steps=4", "evaluation.interval=2",
    ]  # fmt: skip
    cmd = _command("torchrun")
    assert cmd[:3] == ["torchrun", "--nproc-per-node", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
    cmd += [x for o in overrides for x in ("--set", o)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "eval at step 0: reward" in out.stdout

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]
    suffixes = ("reward_mean", "pass_at_1", "pass_at_4", "response_length")
    keys = {f"eval/{s}" for s in suffixes}
    keys |= {f"eval/toy/{op}/{s}" for op in ("plus", "minus") for s in suffixes}
    for m in lines:
        evals = {k for k in m if k.startswith("eval/")}
        assert evals == (keys if m["step"] in (0, 2, 4) else set()), (m["step"], sorted(m))
        if evals:
            assert 0.0 <= m["eval/pass_at_1"] <= m["eval/pass_at_4"] <= 1.0
            assert 0.0 <= m["eval/reward_mean"] <= 1.0 and m["eval/response_length"] >= 1
            assert m["perf/eval_seconds"] > 0
        if m["step"] == 0:  # before training: the evaluation only
            assert set(m) == keys | {"step", "perf/eval_seconds"}
        else:  # the verl-signature dict reward: its score and its extra key
            assert 0.0 <= m["reward/mean"] <= 1.0 and 0.0 <= m["reward/answered"] <= 1.0
            assert m["optim/skipped_steps"] == 0.0
