"""The trainer starts from a checkpoint written by the conversion tool.

A tiny random transformers Qwen3 (the toy task's 13-token vocabulary) is converted with
``hf_to_mcore`` (TP=1 layout) and trained for 2 steps under ``torchrun`` at TP=2 (resharding on
load) from a recipe without a ``model`` section: the model comes from the checkpoint's
``model_config.yaml``. Step 1's rollout log-probs (the loaded policy, before any update) must
equal the transformers model's log-probs of the same tokens, which a model that was not loaded
(Megatron's random init, near-uniform) cannot match. The config-resolution rules are unit-tested
on hand-written ``model_config.yaml`` files.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_grpo.config import ConfigError, to_dict
from megatron_grpo.convert.layout import MODEL_CONFIG_NAME, write_model_config
from megatron_grpo.megatron.config import ModelConfig
from megatron_grpo.train.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # fp32 log-probs, transformers vs Megatron at TP=2
_HF = dict(vocab_size=13, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
# No model section: it comes from checkpoint.load's model_config.yaml.
_RECIPE = {
    "parallel": {"tensor_model_parallel_size": 2},
    "rollout": {"task": "reverse_digits", "num_prompts": 4, "group_size": 2,
                "max_prompt_length": 8, "max_response_length": 4},
    "optimizer": {"lr": 1e-3, "weight_decay": 0.0},
    "training": {"steps": 2, "micro_batch_size": 8, "use_reference_model": True},
    "logging": {"progress_bar": False},
}  # fmt: skip


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _fake_converted(tmp_path: Path, **model) -> Path:
    """A directory holding only a model_config.yaml (what load_train_config reads)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_model_config(ckpt, ModelConfig(vocab_size=13, max_sequence_length=32, **model))
    return ckpt


def test_model_section_comes_from_the_checkpoint(tmp_path):
    ckpt = _fake_converted(tmp_path, rotary_base=500000)
    recipe = _write(tmp_path / "r.yaml", {**_RECIPE, "checkpoint": {"load": str(ckpt)}})
    cfg = load_train_config(recipe)
    assert to_dict(cfg.model) == yaml.safe_load((ckpt / MODEL_CONFIG_NAME).read_text())
    assert cfg.model.rotary_base == 500000  # not the ModelConfig default (10000)
    # --set model.X=... applies on top of the checkpoint's model section
    cfg = load_train_config(recipe, ["model.params_dtype=bfloat16", "model.hidden_dropout=0.1"])
    assert cfg.model.params_dtype == "bfloat16" and cfg.model.hidden_dropout == 0.1
    assert cfg.model.rotary_base == 500000
    # ... but not a different architecture
    with pytest.raises(ConfigError, match="rotary_base is 10000, but the checkpoint has 500000"):
        load_train_config(recipe, ["model.rotary_base=10000"])


def test_explicit_model_section_must_match_the_checkpoint(tmp_path):
    ckpt = _fake_converted(tmp_path)
    stored = yaml.safe_load((ckpt / MODEL_CONFIG_NAME).read_text())
    base = {**_RECIPE, "checkpoint": {"load": str(ckpt)}}
    cfg = load_train_config(_write(tmp_path / "same.yaml", {**base, "model": stored}))
    assert to_dict(cfg.model) == stored
    other = {**stored, "hidden_size": 128}
    with pytest.raises(ConfigError, match="model: hidden_size is 128, but the checkpoint has 64"):
        load_train_config(_write(tmp_path / "other.yaml", {**base, "model": other}))


def test_omitted_model_section_needs_a_converted_checkpoint(tmp_path):
    plain = tmp_path / "trainer_step"  # e.g. a trainer step_N directory: no model_config.yaml
    plain.mkdir()
    recipe = _write(tmp_path / "r.yaml", {**_RECIPE, "checkpoint": {"load": str(plain)}})
    with pytest.raises(ConfigError, match=f"has no {MODEL_CONFIG_NAME}.*add a model section"):
        load_train_config(recipe)
    # without checkpoint.load an omitted model section keeps the built-in default
    no_load = _write(tmp_path / "n.yaml", _RECIPE)
    assert load_train_config(no_load).model.vocab_size == 16


def _save_tiny_hf(out: Path) -> Path:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3"](**_HF))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # far from init (norm gains != 1): a mis-laid tensor shows
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(out)
    return out


def _hf_logprobs(hf_dir: Path, prompts: list[list[int]], responses: list[list[int]]) -> list:
    """Per response token, log softmax of the transformers model's fp32 logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            logits = model(torch.tensor([p + r])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)[len(p) - 1 : -1]
            out.append(lp.gather(1, torch.tensor(r)[:, None])[:, 0].tolist())
    return out


def _torchrun(recipe: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["-m", "megatron_grpo.train", "--config", str(recipe)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_tp2_trains_from_a_converted_hf_checkpoint(tmp_path):
    from megatron_grpo.convert import hf_to_mcore
    from megatron_grpo.rollout.files import read_rollouts

    hf = _save_tiny_hf(tmp_path / "hf")
    ckpt = hf_to_mcore(hf, tmp_path / "mcore")  # TP=1 layout, vocab padded 13 -> 128
    logs, rollouts = tmp_path / "logs", tmp_path / "rollouts"
    recipe = {**_RECIPE, "checkpoint": {"load": str(ckpt)}}
    recipe["rollout"] = {**_RECIPE["rollout"], "output_dir": str(rollouts)}
    recipe["logging"] = {**_RECIPE["logging"], "dir": str(logs)}
    _torchrun(_write(tmp_path / "recipe.yaml", recipe))

    resolved = yaml.safe_load((logs / "config.yaml").read_text())
    assert resolved["model"]["hidden_size"] == 64 and resolved["model"]["qk_layernorm"]
    # Step 1 is sampled before any update: the rollout log-probs are the loaded policy's.
    batch = read_rollouts(rollouts / "rollouts_step00000001_dp0000.jsonl")
    ref = _hf_logprobs(hf, batch.prompt_ids, batch.response_ids)
    got, want = sum(batch.rollout_logprobs, []), sum(ref, [])
    diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert diff <= TOL, f"max |log-prob difference| transformers vs trainer (TP=2): {diff:.2e}"
    # Discriminative: an unloaded (randomly initialized) model is near-uniform over 13 tokens.
    assert max(abs(w + math.log(13)) for w in want) > 0.5
    metrics = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # The training pass's old log-probs equal the rollout ones (both the loaded weights), and
    # the reference model was loaded from the same directory: KL 0 at step 1, > 0 after updates.
    assert abs(metrics[0]["mismatch/k1"]) <= TOL
    assert metrics[0]["loss/kl_mean"] <= 1e-8 < metrics[1]["loss/kl_mean"]
