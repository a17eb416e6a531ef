"""tools/bench_async.py: a run that hangs past --run-timeout leaves each process's stacks."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_async  # noqa: E402


def test_a_hung_run_dumps_its_stacks(tmp_path, monkeypatch):
    """The launcher's ranks live in sessions of their own (as torchrun starts them): each one
    still leaves its stack and none outlives the run."""
    monkeypatch.setattr(bench_async, "ABORT_GRACE_S", 2)
    rank = "import time\ndef waiting_for_a_peer():\n    time.sleep(60)\nwaiting_for_a_peer()\n"
    (tmp_path / "rank.py").write_text(rank)
    launcher = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, {str(tmp_path / 'rank.py')!r}], "
        "start_new_session=True)\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(p.pid))\n"
        "def agent_waits():\n    p.wait()\nagent_waits()\n"
    )
    (tmp_path / "launcher.py").write_text(launcher)
    with open(tmp_path / "run.log", "w") as log:
        code = bench_async.launch([sys.executable, str(tmp_path / "launcher.py")], log, timeout=3)
    text = (tmp_path / "run.log").read_text()
    assert code == bench_async.TIMED_OUT
    assert "Fatal Python error: Aborted" in text and "waiting_for_a_peer" in text, text
    rank_pid = int((tmp_path / "pid").read_text())
    assert not Path(f"/proc/{rank_pid}").exists() or _zombie(rank_pid), "a rank outlived the run"


def _zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_run_within_its_time_keeps_its_exit_code(tmp_path):
    with open(tmp_path / "run.log", "w") as log:
        assert bench_async.launch([sys.executable, "-c", "raise SystemExit(4)"], log, 30) == 4
