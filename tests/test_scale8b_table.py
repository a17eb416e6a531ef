"""tools/scale8b_table.py (the table of ``gpu_e2e.sh scale8b``): FLOP arithmetic and a table from
fake run directories."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import scale8b_table as st  # noqa: E402


def test_qwen3_8b_matmul_weights_and_mfu():
    n = st.matmul_params(st.QWEN3_8B)
    assert 7.5e9 < n < 7.6e9  # 6.95B decoder matmuls + 0.62B LM head (no norms, embedding)
    per_token = st.train_flops_per_token(st.QWEN3_8B, 1)
    assert per_token == pytest.approx(6 * n + 3 * 2 * 32 * 128 * 2 * 36)
    # 1000 tok/s/GPU on 4 GPUs at 989 TFLOP/s
    got = st.mfu(4000.0, 32768, 4, 989.0)
    assert got == pytest.approx(1000 * st.train_flops_per_token(st.QWEN3_8B, 32768) / 989e12)
    with pytest.raises(ValueError, match="gpus and peak_tflops"):
        st.mfu(1.0, 8, 0, 989.0)


def test_table_from_run_directories(tmp_path):
    run = tmp_path / "scale8b_b_fused"
    run.mkdir()
    steps = [{"perf/step_seconds": 99.0}] + [
        {"perf/step_seconds": 10.0, "perf/update_seconds": 8.0, "perf/rollout_seconds": 1.0,
         "perf/logprob_seconds": 1.0, "perf/tokens_per_s": 4000.0,
         "perf/train_tokens_per_s": 5000.0}
        for _ in range(2)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "scale8b_rollouts").mkdir()  # the synthetic data: not a run
    out = tmp_path / "t.md"
    assert st.main([str(tmp_path), str(out), "--gpus", "4"]) == 0
    [line] = [x for x in out.read_text().splitlines() if x.startswith("| b ")]
    mfu = st.mfu(5000.0, 32768, 4, 989.0)
    assert line.startswith("| b | 2 | 10.00 | 1.00 | 1.00 | 8.00 | 1000 | 1250 | ")
    assert f"| {mfu:.3f} |" in line
