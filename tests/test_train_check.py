"""``python -m megatron_grpo.train --check`` (issue 39): every mistake of a recipe at once with
its FILE:LINE and did-you-mean, then its files and reward, without megatron-core; --dry-run and
training run the same checks first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_grpo.train.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny.yaml"
MISTAKES = """\
rollout:
  num_promts: 8
  group_size: two
  sampling:
    temperature: -1
trainig:
  steps: 3
"""


def test_check_reports_every_mistake_with_its_line(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MISTAKES)
    assert main(["--config", str(recipe), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: 4 mistakes in {recipe}:"), err
    for line in (
        f"{recipe}:2: unknown config key 'rollout.num_promts'; did you mean 'num_prompts'?",
        f"{recipe}:3: rollout.group_size: expected an integer, got 'two'",
        f"{recipe}:5: rollout.sampling.temperature must be > 0",
        f"{recipe}:6: unknown config key 'trainig'; did you mean 'training'?",
    ):
        assert f"\n  {line}" in err, (line, err)


def test_a_bool_for_a_section_suggests_its_enabled_key(capsys):
    assert main(["--config", str(RECIPE), "--set", "rollout.partial=true", "--check"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'rollout.partial.enabled=true'?" in err, err


def test_check_names_every_missing_file_and_dry_run_fails_on_them(tmp_path, capsys):
    sets = [
        "rollout.task=dataset", f"rollout.dataset.train_files=[{tmp_path}/a.jsonl]",
        f"rollout.dataset.tokenizer_dir={tmp_path}/tok", f"rollout.reward_fn={tmp_path}/r.py:f",
    ]  # fmt: skip
    args = [x for s in sets for x in ("--set", s)]
    for mode in ("--check", "--dry-run"):
        assert main(["--config", str(RECIPE), *args, mode]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: 3 problems with the run's inputs:"), err
        assert f"rollout.dataset.train_files[0]: no such file '{tmp_path}/a.jsonl'" in err
        assert f"rollout.dataset.tokenizer_dir: no such directory '{tmp_path}/tok'" in err
        assert f"rollout.reward_fn: no file '{tmp_path}/r.py'" in err


def test_check_of_a_good_recipe_imports_no_megatron_core():
    code = (
        "import sys\n"
        "from megatron_grpo.train.__main__ import main\n"
        "rc = main(['--config', 'recipes/tiny.yaml', '--check'])\n"
        "assert not [m for m in sys.modules if m.startswith('megatron.core')], 'megatron-core'\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok: recipes/tiny.yaml") and "task reverse_digits" in out.stdout
    assert len(out.stdout.splitlines()) <= 20
