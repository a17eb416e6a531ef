"""tools/bench_async.py: a run that hangs past --run-timeout leaves each process's stacks."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_async  # noqa: E402


def test_a_hung_run_dumps_its_stacks(tmp_path):
    hang = "import time\ndef waiting_for_a_peer():\n    time.sleep(60)\nwaiting_for_a_peer()\n"
    script = tmp_path / "hang.py"
    script.write_text(hang)
    with open(tmp_path / "run.log", "w") as log:
        code = bench_async.launch([sys.executable, str(script)], log, timeout=3)
    text = (tmp_path / "run.log").read_text()
    assert code != 0
    assert "Fatal Python error: Aborted" in text and "waiting_for_a_peer" in text, text


def test_a_run_within_its_time_keeps_its_exit_code(tmp_path):
    with open(tmp_path / "run.log", "w") as log:
        assert bench_async.launch([sys.executable, "-c", "raise SystemExit(4)"], log, 30) == 4
