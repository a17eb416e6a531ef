"""The trainer's command line: a world size that does not fit the recipe is one line with the
fix (exit 2, no traceback); the dry run defaults to the smallest world the layout fits."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.megatron.config import ParallelConfig
from megatron_grpo.train.__main__ import (
    help_description,
    main,
    parse_args,
    smallest_world_size,
    world_size_hint,
)

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"


def test_forgetting_torchrun_names_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["--config", str(RECIPE), "--set", f"logging.dir={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("config error: 1 rank(s)") and "Traceback" not in err
    assert "torchrun --nproc-per-node 2" in err
    assert "--set parallel.tensor_model_parallel_size=1" in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_dry_run_defaults_to_the_recipes_smallest_world(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--config", str(RECIPE), "--dry-run"]) == 0
    assert "config error" not in capsys.readouterr().err


@pytest.mark.parametrize("columns", [60, 100, 200])
def test_help_reads_as_plain_text(columns, monkeypatch, capsys):
    """--help shows the module docstring without its RST markup, in paragraphs that fit the
    terminal (at most 100 columns), and never repeats the usage line as prose."""
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and "`" not in out
    description = out.split("\n\n")[1:6]
    assert description[0].startswith("--check checks the recipe (every mistake at once")
    assert description[1].startswith("--dry-run [--world-size N] prints the rank layout")
    assert description[2].startswith("Runs under torchrun (single node")
    assert " ".join(description[4].split()).startswith("Exit codes: 0 done, 1 a failed run")
    assert all(len(line) <= min(columns, 100) - 2 for p in description for line in p.splitlines())
    assert "python -m megatron_grpo.train --config recipes/tiny.yaml" not in out


def test_help_description_keeps_paragraphs_and_words():
    doc = "``cmd``.\n\nA ``b.c`` d\ne-f g.\n\nExit codes: 0."
    assert help_description(doc, width=5) == "A b.c\nd e-f\ng.\n\nExit\ncodes:\n0."


def test_smallest_world_size_counts_the_expert_layout():
    assert smallest_world_size(ParallelConfig(tensor_model_parallel_size=2)) == 2
    moe = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=4)
    assert smallest_world_size(moe) == 8
    cp = ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=3)
    hint = world_size_hint(cp, 4)
    assert "needs a multiple of 6" in hint and "a world size that is a multiple of 6" in hint


def _failing_reward_body(rank: int, world: int, tmp_path: Path) -> None:
    import contextlib
    import io

    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(prompt, response, answer):\n    return 1 / 0\n")
    sets = [
        "parallel.tensor_model_parallel_size=1", "rollout.num_prompts=2", "rollout.group_size=2",
        "training.steps=2", "checkpoint.dir=null", f"logging.dir={tmp_path / 'run'}",
        f"rollout.reward_fn={reward}:score", "logging.progress_bar=false",
    ]  # fmt: skip
    argv = ["--config", str(RECIPE)] + [x for s in sets for x in ("--set", s)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 1
    lines = err.getvalue().strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "ZeroDivisionError" in errors[0] and "score" in errors[0], lines
    # then the user's own frame (file:line and its source), none of megatron_grpo's
    assert lines[lines.index(errors[0]) + 1 :] == [f"  {reward}:2: return 1 / 0"], lines
    assert "Traceback" not in err.getvalue()


def test_a_failing_reward_is_one_line_and_exit_1(tmp_path):
    from tests.dist_utils import run_distributed

    run_distributed(_failing_reward_body, 1, tmp_path)


def test_reward_errors_print_from_the_failing_replica(monkeypatch, capsys):
    """Bad input is printed by rank 0 (every rank meets it); a reward failure by the first rank
    of the replica that failed, which need not be rank 0 (data parallel)."""
    from megatron_grpo.errors import InputError
    from megatron_grpo.rollout.tasks.reward import RewardError
    from megatron_grpo.train import __main__ as cli

    monkeypatch.setenv("RANK", "2")  # DP replica 1 of TP 2: its first rank, not rank 0
    monkeypatch.setattr(cli, "_replica_leader", lambda: True)
    assert cli.report_error(RewardError("rollout.reward_fn 'f.py:g' failed: boom")) == 1
    assert capsys.readouterr().err == "error: rollout.reward_fn 'f.py:g' failed: boom\n"
    assert cli.report_error(InputError("data.parquet:3: no column 'prompt'")) == 2
    assert capsys.readouterr().err == ""  # rank 0 prints what every rank meets
    monkeypatch.setattr(cli, "_replica_leader", lambda: False)
    cli.report_error(RewardError("boom"))
    assert capsys.readouterr().err == ""
