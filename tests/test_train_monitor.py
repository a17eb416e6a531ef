"""The per-step monitor: JSONL lines, TensorBoard scalars, and truncation on resume."""

from __future__ import annotations

import json

import pytest

from megatron_grpo.train.config import LoggingConfig
from megatron_grpo.train.monitor import Monitor, truncate_jsonl


def test_jsonl_lines_and_resume_truncation(tmp_path):
    cfg = LoggingConfig(dir=str(tmp_path), progress_bar=False)
    mon = Monitor(cfg, total_steps=3, enabled=True)
    for step in (1, 2, 3):
        mon.log(step, {"reward/mean": 0.1 * step, "loss/kl_mean": float("nan")})
    mon.close()
    rows = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["reward/mean"] == pytest.approx(0.2) and rows[1]["loss/kl_mean"] is None
    truncate_jsonl(cfg.metrics_path, 2)
    assert [json.loads(x)["step"] for x in cfg.metrics_path.read_text().splitlines()] == [1, 2]


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tb"
    cfg = LoggingConfig(dir=str(tmp_path), tensorboard_dir=str(tb_dir), progress_bar=False)
    mon = Monitor(cfg, total_steps=2, enabled=True)
    mon.log(1, {"reward/mean": 0.25})
    mon.log(2, {"reward/mean": 0.75})
    mon.close()
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    values = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    assert values == [(1, 0.25), (2, 0.75)]


def test_progress_line_shows_throughput_and_the_stage_split(tmp_path, capsys):
    mon = Monitor(LoggingConfig(dir=str(tmp_path)), total_steps=2, enabled=True)
    perf = {"perf/rollout_seconds": 0.9, "perf/logprob_seconds": 0.2}
    perf |= {"perf/update_seconds": 0.4, "perf/step_seconds": 1.52}
    perf |= {"perf/generation_tokens_per_s": 1234.4, "perf/train_tokens_per_s": 5678.0}
    mon.log(1, {"reward/mean": 0.5, **perf})
    line = capsys.readouterr().out
    assert "gen tok/s 1234 | train tok/s 5678" in line
    assert "1.52s = rollout 0.90 + logprob 0.20 + update 0.40" in line


def test_eval_before_training_is_one_eval_line_and_waits_for_the_first_step(tmp_path, capsys):
    """The evaluation before training prints its numbers, not a bare `step 0/N` line; nothing
    is written (nor the callbacks of at_first_step run) until step 1 completes (issue 39)."""
    cfg = LoggingConfig(dir=str(tmp_path / "run"), progress_bar=True)
    mon = Monitor(cfg, total_steps=20, enabled=True)
    started = []
    mon.at_first_step(lambda: started.append(True))
    mon.log(0, {"eval/reward_mean": 0.25, "eval/pass_at_1": 0.125})
    out = capsys.readouterr().out
    assert "before training: eval reward 0.250, pass@1 0.125" in out and "step 0/" not in out
    assert not (tmp_path / "run").exists() and not started
    mon.log(1, {"reward/mean": 0.5})
    rows = [json.loads(x) for x in cfg.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and started == [True]
