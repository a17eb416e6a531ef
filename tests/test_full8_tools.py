"""tools/full8_plan.py and tools/full8_table.py (``gpu_e2e.sh full8``, issue 40): the layer count
that fits is the largest the dry run's plan allows, and the table's active-FLOP MFU and planned
peak from a run directory holding the trainer's resolved config.yaml."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import full8_plan as fp  # noqa: E402
import full8_table as ft  # noqa: E402
import scale8b_table as st  # noqa: E402

MOE = str(ROOT / "recipes" / "qwen3_30b_a3b_moe.yaml")
BASE = ["checkpoint.load=null", "rollout.num_prompts=4"]


def test_qwen3_30b_a3b_active_weights():
    n = st.matmul_params(st.QWEN3_30B_A3B)
    # 48 x (attention 18.9M + router 0.26M + 8 experts x 4.72M) + LM head 0.31B: the model's
    # "3.3B activated" less the input embedding (0.31B) and the norms
    assert 3.0e9 < n < 3.1e9
    dense = dict(st.QWEN3_30B_A3B, experts=None)  # every layer a dense SwiGLU of ffn 6144
    h = 2048
    assert n - st.matmul_params(dense) == 48 * (h * 128 + 8 * 3 * h * 768 - 3 * h * 6144)


def test_fit_layers_is_the_largest_count_that_fits():
    best = fp.fit_layers(MOE, BASE, 8, 79.1)
    assert best.peak_gib <= best.budget_gib == pytest.approx(0.85 * 79.1)
    over = fp.plan(MOE, [*BASE, f"model.num_layers={best.layers + 1}"], 8, 79.1)
    assert over.peak_gib > over.budget_gib
    assert 1 <= best.layers < 48
    # EP 4 on 4 ranks holds twice the experts per rank: fewer layers fit
    assert fp.fit_layers(MOE, [*BASE, "parallel.expert_model_parallel_size=4"], 4, 79.1).layers < (
        best.layers
    )
    assert fp.fit_layers(MOE, BASE, 8, 1000.0).layers == 48  # capped at the recipe's count


def test_fit_layers_respects_pipeline_stages_and_says_when_nothing_fits(capsys):
    sets = [*BASE, "parallel.pipeline_model_parallel_size=2"]
    got = fp.fit_layers(MOE, sets, 16, 79.1)
    assert got.layers % 2 == 0 and got.peak_gib <= got.budget_gib
    assert fp.main(["--config", MOE, "--world-size", "8", "--device-memory-gib", "6",
                    "--fit-layers", *(x for s in BASE for x in ("--set", s))]) == 2  # fmt: skip
    assert "model.num_layers=1 (one per pipeline stage) already plans" in capsys.readouterr().err


def _run_dir(tmp_path: Path, name: str, overrides: list[str]) -> Path:
    from megatron_grpo.config.base import to_dict
    from megatron_grpo.train.config import load_train_config

    run = tmp_path / name
    run.mkdir()
    cfg = load_train_config(MOE, overrides)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    steps = [{"perf/step_seconds": 99.0, "perf/peak_memory_gib": 61.0}] + [
        {"perf/step_seconds": 10.0, "perf/rollout_seconds": 1.0, "perf/logprob_seconds": 1.0,
         "perf/update_seconds": 8.0, "perf/tokens_per_s": 8000.0,
         "perf/train_tokens_per_s": 10000.0, "perf/peak_memory_gib": 60.0}
        for _ in range(2)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return run


def test_table_of_a_moe_run(tmp_path):
    sets = [*BASE, "model.num_layers=12"]
    _run_dir(tmp_path, "full8_moe_file_fused", sets)
    (tmp_path / "full8_moe_file_fused.smi").write_text("100\n70000\n69000\n")
    (tmp_path / "full8_moe_rollouts").mkdir()  # the synthetic data: not a run
    out = tmp_path / "t.md"
    assert ft.main([str(tmp_path), str(out), "--gpus", "8", "--device-memory-gib", "79.1"]) == 0
    [line] = [x for x in out.read_text().splitlines() if x.startswith("| moe_file ")]
    shape = dict(st.QWEN3_30B_A3B, layers=12)
    mfu = st.mfu(10000.0, 2048 + 14336, 8, 989.0, shape)
    planned = fp.plan(MOE, sets, 8, 79.1).peak_gib
    assert line.startswith("| moe_file | TP2+SP DP4 EP8 | 12 | 2 | 10.00 | 1.00 | 1.00 | 8.00 | ")
    assert f"| 1000 | 1250 | {mfu:.3f} | 61.0 | {planned:.1f} | 70000 | full (uniform" in line
