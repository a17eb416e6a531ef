"""A run's start (issue 39): nothing in the run directory changes until the first new step
completes (a failed --resume keeps the config that trained the checkpoints), a changed resume
keeps the previous config as config.stepN.yaml, handled error exits release their locks and leave
no empty run folders, and a reward that returns no number exits 2 naming the sample."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETS = [
    "parallel.tensor_model_parallel_size=1", "rollout.num_prompts=2", "rollout.group_size=2",
    "training.micro_batch_size=4", "logging.progress_bar=false", "checkpoint.save_interval=1",
]  # fmt: skip


def _train(run: Path, *extra: str, resume: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_grpo.train", "--config", "recipes/tiny.yaml"]
    sets = [*SETS, f"logging.dir={run}", f"checkpoint.dir={run}/ckpt", *extra]
    cmd += [x for s in sets for x in ("--set", s)] + (["--resume"] if resume else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_failed_resume_changes_nothing_and_a_changed_resume_keeps_the_old_config(tmp_path):
    run = tmp_path / "run"
    (tmp_path / "rewards.py").write_text(
        "def boom(prompt, response, answer):\n    raise ValueError('boom')\n\n\n"
        "def none(prompt, response, answer):\n    return None\n"
    )
    first = _train(run, "training.steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    before = _snapshot(run)
    assert "config.yaml" in before
    # a resume with new settings whose reward raises in its first step: exit 1, nothing changed
    failed = _train(
        run, "training.steps=4", f"rollout.reward_fn={tmp_path}/rewards.py:boom", resume=True
    )
    assert failed.returncode == 1 and "failed on prompt" in failed.stderr, failed.stderr[-2000:]
    assert _snapshot(run) == before
    # its lock was released: the next run has no stale-lock notice
    changed = _train(run, "training.steps=3", "optimizer.lr=2e-6", resume=True)
    assert changed.returncode == 0 and "stale lock" not in changed.stderr, changed.stderr
    assert (run / "config.step2.yaml").read_bytes() == before["config.yaml"]
    assert "lr: 2.0e-06" in (run / "config.yaml").read_text()
    assert "config.step2.yaml keeps the previous config" in changed.stdout
    # a fresh run whose reward returns None: exit 2 naming the sample, no run folder left
    fresh = tmp_path / "fresh"
    bad = _train(fresh, "training.steps=1", f"rollout.reward_fn={tmp_path}/rewards.py:none")
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "returned NoneType for prompt 0" in bad.stderr and "Traceback" not in bad.stderr
    assert not fresh.exists()
