"""End to end: the contract command trains (reward rises), a plain ``python -m`` run (world of
one) writes its outputs, file rollouts train, and non-finite inputs skip steps then abort."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny.yaml"


def _run(cmd: list[str], timeout: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _rewards(path: Path) -> list[float]:
    return [json.loads(line)["reward/mean"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_tiny_recipe_under_torchrun_raises_the_reward(tmp_path):
    """The README command, shortened to 20 steps (the full recipe runs 60)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["-m", "megatron_grpo.train", "--config", str(RECIPE)]
    cmd += ["--set", "training.steps=20", "--set", f"logging.dir={tmp_path}"]
    cmd += ["--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "logging.progress_bar=false"]
    _run(cmd, timeout=600)
    rewards = _rewards(tmp_path / "metrics.jsonl")
    assert len(rewards) == 20
    assert rewards[0] < 0.15  # chance: ~1/13 per position
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.3, rewards
    assert (tmp_path / "config.yaml").is_file()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000020"


@pytest.mark.slow
def test_plain_python_run_is_a_world_of_one(tmp_path):
    cmd = [sys.executable, "-m", "megatron_grpo.train", "--config", str(RECIPE)]
    for o in [
        "parallel.tensor_model_parallel_size=1",
        "training.steps=2",
        "training.mini_batches_per_step=1",
        "rollout.num_prompts=4",
        f"logging.dir={tmp_path}",
        "checkpoint.dir=null",
        f"rollout.output_dir={tmp_path / 'rollouts'}",
    ]:
        cmd += ["--set", o]
    _run(cmd, timeout=300)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert "reward/mean" in metrics[0] and "loss/kl_mean" in metrics[0]
    # One on-policy update per step: step 1 is scored before any update, so the policy equals
    # the reference (same seed, same initialization) and the KL is exactly zero.
    assert metrics[0]["loss/kl_mean"] == 0.0 and metrics[1]["loss/kl_mean"] > 0.0
    files = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert files == ["rollouts_step00000001_dp0000.jsonl", "rollouts_step00000002_dp0000.jsonl"]


def _file_body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.rollout.batch import RolloutBatch
    from megatron_grpo.rollout.files import write_rollouts
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import NonFiniteError, Trainer

    def batch(logprob: float) -> RolloutBatch:
        prompts = [[11, d, (d + 1) % 10, 10] for d in range(4) for _ in range(2)]
        responses = [[(d + 1) % 10, d, 12] for d in range(4) for _ in range(2)]
        return RolloutBatch(
            prompts, responses, [d for d in range(4) for _ in range(2)],
            [[logprob] * 3 for _ in prompts], [float(i % 2) for i in range(8)],
        )  # fmt: skip

    write_rollouts(batch(-2.0), tmp / "good" / "r.jsonl")
    write_rollouts(batch(math.nan), tmp / "bad" / "r.jsonl")
    base = [
        "parallel.tensor_model_parallel_size=1",
        "rollout.num_prompts=2",
        "rollout.group_size=2",
        "training.micro_batch_size=2",
        "loss.is_correction_level=token",
        "training.max_consecutive_nonfinite_skips=2",
        f"logging.dir={tmp / 'logs'}",
        "checkpoint.dir=null",
    ]
    good = load_train_config(
        RECIPE, base + ["training.steps=2", f"rollout.input_path={tmp / 'good'}"]
    )
    history = Trainer(good).train()
    assert [h["optim/skipped_steps"] for h in history] == [0.0, 0.0]
    assert history[0]["reward/mean"] == 0.5 and "mismatch/k3" in history[0]
    # Read, not generated: stage times but no generation rate or engine counters.
    assert history[0]["perf/rollout_seconds"] > 0.0 and history[0]["perf/update_seconds"] > 0.0
    assert not any(k in history[0] for k in ("perf/generation_tokens_per_s", "rollout/kv_slots"))
    bad = load_train_config(
        RECIPE, base + ["training.steps=2", f"rollout.input_path={tmp / 'bad'}"]
    )
    with pytest.raises(NonFiniteError, match="non-finite input\\(s\\): rollout_logprobs"):
        Trainer(bad, overwrite=True).train()
    too_short = base + ["training.steps=3", f"rollout.input_path={tmp / 'good'}"]
    with pytest.raises(ValueError, match="has 4 groups, training.steps"):
        Trainer(load_train_config(RECIPE, too_short), overwrite=True)


@pytest.mark.slow
def test_file_rollouts_train_and_nonfinite_inputs_skip_then_abort(tmp_path):
    run_distributed(_file_body, 1, tmp_path)


def _cp_body(rank: int, world: int, tmp: Path) -> None:
    import torch.distributed as dist

    from megatron_grpo.rollout.batch import RolloutBatch
    from megatron_grpo.rollout.files import write_rollouts
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    prompts = [[11, d, (d + 1) % 10, 10] for d in range(4) for _ in range(2)]
    responses = [[(d + 1) % 10, d, 12][: 1 + d % 3] for d in range(4) for _ in range(2)]
    batch = RolloutBatch(
        prompts, responses, [d for d in range(4) for _ in range(2)],
        [[-2.0] * len(r) for r in responses], [float(i % 2) for i in range(8)],
    )  # fmt: skip
    if rank == 0:
        write_rollouts(batch, tmp / "rollouts" / "r.jsonl")
    dist.barrier()  # the trainer reads the file on every rank
    overrides = [
        "parallel.tensor_model_parallel_size=1",
        "parallel.context_parallel_size=2",
        "model.position_embedding_type=rope",  # CP-aware THD RoPE positions
        "rollout.num_prompts=2",
        "rollout.group_size=2",
        f"rollout.input_path={tmp / 'rollouts'}",
        "training.steps=2",
        f"logging.dir={tmp / 'logs'}",
        "checkpoint.dir=null",
    ]
    history = Trainer(load_train_config(RECIPE, overrides)).train()
    for h in history:
        assert h["optim/skipped_steps"] == 0.0 and math.isfinite(h["loss/loss"]), h
        assert h["optim/grad_norm"] > 0.0


@pytest.mark.slow
def test_context_parallel_trains_from_rollout_files(tmp_path):
    """CP = 2 without Transformer Engine (the portable spec's all-gather CP attention)."""
    run_distributed(_cp_body, 2, tmp_path)


PERF_KEYS = (
    "perf/rollout_seconds", "perf/logprob_seconds", "perf/update_seconds", "perf/step_seconds",
    "perf/generation_tokens_per_s", "perf/train_tokens_per_s", "perf/tokens_per_s",
)  # fmt: skip


def _long_body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    recipe = ROOT / "recipes" / "tiny_long.yaml"
    base = [
        "parallel.tensor_model_parallel_size=1",
        "rollout.num_prompts=4",
        "training.micro_batch_size=16",
        "training.steps=2",
    ]
    cfg = load_train_config(recipe, base + [f"logging.dir={tmp / 'kv'}"])
    assert cfg.rollout.reverse_digits.num_digits == 32 and cfg.rollout.engine.kind == "kv_cache"
    history = Trainer(cfg).train()
    logged = [json.loads(line) for line in (tmp / "kv" / "metrics.jsonl").read_text().splitlines()]
    for h, row in zip(history, logged, strict=True):
        for key in PERF_KEYS:
            assert h[key] > 0.0 and row[key] == pytest.approx(h[key]), key
        assert h["rollout/kv_slots"] == 32.0  # 4 prompts x 8 samples fit the budget at once
        assert h["rollout/decode_steps"] >= h["response/length_mean"] - 1
        assert h["perf/step_seconds"] >= h["perf/rollout_seconds"] + h["perf/update_seconds"]
    recompute = [f"logging.dir={tmp / 're'}", "rollout.engine.kind=recompute", "training.steps=1"]
    [h] = Trainer(load_train_config(recipe, base + recompute)).train()
    assert h["perf/generation_tokens_per_s"] > 0.0 and "rollout/kv_slots" not in h


@pytest.mark.slow
def test_tiny_long_recipe_logs_the_stage_split_and_throughput(tmp_path):
    """The long-response recipe, 2 steps in a world of one, with both engines."""
    run_distributed(_long_body, 1, tmp_path)
