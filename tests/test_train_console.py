"""The console of a run: the fitted progress line, the non-TTY mode, the end-of-run summary, the
config summary and the collected megatron-core / torch warnings."""

from __future__ import annotations

import json
import logging
import warnings

import pytest

from megatron_grpo.train.__main__ import _summary
from megatron_grpo.train.config import LoggingConfig, load_train_config
from megatron_grpo.train.monitor import (
    Monitor,
    WarningLog,
    config_summary,
    progress_line,
    read_metrics,
)

METRICS = {
    "reward/mean": 0.216,
    "loss/loss": -0.0287,
    "loss/kl_mean": 0.3928,
    "loss/clipfrac": 0.005,
    "perf/generation_tokens_per_s": 8728.0,
    "perf/train_tokens_per_s": 10936.0,
    "perf/step_seconds": 0.51,
    "perf/rollout_seconds": 0.12,
    "perf/logprob_seconds": 0.18,
    "perf/update_seconds": 0.21,
    "perf/tokens_per_s": 3900.0,
}


@pytest.mark.parametrize("width", [1, 5, 20, 30, 40, 60, 80, 100, 120, 200])
def test_progress_line_never_exceeds_the_width(width):
    line = progress_line(5, 60, METRICS, width)
    assert len(line) <= width - 1 or (width == 1 and len(line) == 1)
    assert "\n" not in line and "\r" not in line


def test_progress_line_drops_less_important_fields_first():
    full = progress_line(5, 60, METRICS, None)
    assert "[#" in full and "train tok/s 10936" in full and "0.51s = rollout 0.12" in full
    at_100 = progress_line(5, 60, METRICS, 100)
    assert "[#" not in at_100 and "train tok/s" not in at_100  # the bar and throughputs go first
    assert "step 5/60" in at_100 and "reward 0.216" in at_100 and "0.51s" in at_100
    at_40 = progress_line(5, 60, METRICS, 40)
    assert at_40 == "step 5/60 | reward 0.216 | 0.51s"  # what is kept to the last


def test_non_tty_prints_plain_lines_every_interval(tmp_path, capsys):
    cfg = LoggingConfig(dir=str(tmp_path), print_interval=4)
    mon = Monitor(cfg, total_steps=10, enabled=True)
    for step in range(1, 11):
        mon.log(step, dict(METRICS))
    out = capsys.readouterr().out  # captured: not a TTY
    assert "\r" not in out and "\x1b" not in out
    steps = [line.split("step ")[1].split(" ")[0] for line in out.splitlines()]
    assert steps == ["1/10", "4/10", "8/10", "10/10"]
    assert len(out.splitlines()) == 4
    with pytest.raises(ValueError, match="print_interval"):
        LoggingConfig(dir=str(tmp_path), print_interval=0)


def test_summary_gives_rewards_eval_throughput_and_time_split(tmp_path):
    cfg = load_train_config("recipes/tiny.yaml", [f"logging.dir={tmp_path}", "checkpoint.dir=null"])
    rewards = [0.06, 0.4, 0.9, 0.8]
    rows = []
    for step, r in enumerate(rewards, 1):
        row = {"step": step, **METRICS, "reward/mean": r, "perf/step_seconds": 0.4 + 0.1 * step}
        rows.append(row)
    rows[-1] |= {"eval/reward_mean": 0.75, "eval/pass_at_1": 0.7}
    cfg.logging.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = _summary(cfg, 0, 12.0, read_metrics(cfg.logging.metrics_path), "3 warning(s) in x")
    assert "0.060 (step 1) -> 0.800 (step 4), best 0.900 (step 3)" in text
    assert "eval:        reward 0.750, pass@1 0.700 (step 4)" in text
    assert "3900 tokens/s" in text
    assert "3900 tokens/s, per step 0.65s = rollout 0.12 + logprob 0.18 + update 0.21" in text
    assert "warnings:    3 warning(s) in x" in text
    assert "reward:" not in _summary(cfg, 0, 1.0, [])  # no metrics: no results lines


def test_config_summary_is_short(tmp_path):
    cfg = load_train_config("recipes/tiny.yaml", ["checkpoint.dir=ck"])
    text = config_summary(cfg, 1, tmp_path / "config.yaml")
    assert len(text.splitlines()) <= 7
    assert "0.5M parameters, 2 layers, hidden 128" in text
    assert "TP 2 PP 1 CP 1 EP 1 DP 1" in text
    assert "reverse_digits" in text and "steps:  60 x 32 prompts x 8 samples" in text
    assert "checkpoints: ck (every 20 steps and after the last)" in text


def test_config_summary_fits_100_columns_and_says_when_it_saves(tmp_path):
    sets = ["checkpoint.dir=runs/byo_task/checkpoints", "checkpoint.save_interval=0"]
    sets += ["rollout.reward_fn=rewards/byo_reward.py:compute_score"]
    text = config_summary(load_train_config("recipes/tiny.yaml", sets), 1, "runs/x/config.yaml")
    assert all(len(line) <= 100 for line in text.splitlines()), text
    assert "checkpoints: runs/byo_task/checkpoints (after the last step)" in text


def test_megatron_warnings_go_to_the_log_and_the_console_gets_a_count(tmp_path, capsys):
    path = tmp_path / "warnings.log"
    with WarningLog() as log:
        warnings.warn_explicit("Apex is not installed", UserWarning, "/x/megatron/core/a.py", 1)
        logging.getLogger("megatron.core.models").warning("GPTModel IS DEPRECATED")
        log.attach(path)
        warnings.warn_explicit("deprecated", FutureWarning, "/x/torch/distributed/b.py", 2)
        with pytest.warns(UserWarning, match="ours"):  # ours pass through
            warnings.warn_explicit("ours", UserWarning, "/x/megatron_grpo/c.py", 3)
        print(log.count_line())
    captured = capsys.readouterr()
    assert captured.out == f"3 third-party warning(s) in {path}\n"
    assert "Apex" not in captured.err and "DEPRECATED" not in captured.err
    text = path.read_text()
    assert "Apex is not installed" in text and "GPTModel IS DEPRECATED" in text
    assert "deprecated" in text and "ours" not in text
    assert logging.getLogger("megatron").propagate  # restored


def test_a_rank_that_never_attaches_stays_silent(capsys):
    with WarningLog() as log:
        warnings.warn_explicit("Apex is not installed", UserWarning, "/x/megatron/core/a.py", 1)
    assert log.count == 1 and log.count_line() is None
    assert capsys.readouterr().err == ""


def test_tty_redraws_one_fitted_line(tmp_path, capsys, monkeypatch):
    import os
    import sys

    mon = Monitor(LoggingConfig(dir=str(tmp_path)), total_steps=3, enabled=True)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(
        "megatron_grpo.train.monitor.shutil.get_terminal_size",
        lambda fallback=None: os.terminal_size((60, 24)),
    )
    for step in (1, 2, 3):
        mon.log(step, dict(METRICS))
    out = capsys.readouterr().out
    assert out.count("\r") == 3 and out.endswith("\n") and out.count("\n") == 1
    for line in out.rstrip("\n").split("\r")[1:]:
        assert len(line.removesuffix("\x1b[K")) <= 59


class _Warns(__import__("torch").Tensor):
    """A tensor subclass that warns at its caller (torch's deprecated ShardedTensor does)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        warnings.warn("subclass deprecated", FutureWarning, stacklevel=2)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_subclass_warning_under_cuda_compat_names_the_caller_not_our_mode():
    """megatron_grpo/megatron/parallel.py's CPU mode passes a subclass's calls through: their
    warnings name the torch call's site (a third-party file in a run, for warnings.log)."""
    import torch

    from megatron_grpo.megatron import parallel

    t = torch.zeros(2).as_subclass(_Warns)
    with warnings.catch_warnings(record=True) as caught, parallel.cuda_compat():
        warnings.simplefilter("always")
        t.device  # noqa: B018 - a property read dispatched through __torch_function__
    files = {w.filename for w in caught if "subclass deprecated" in str(w.message)}
    assert files == {__file__}, files
