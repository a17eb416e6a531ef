"""Preemption and time limits (``train/stop.py``): a signal to every rank, to one rank, or to the
whole process group (as Ctrl-C sends it) stops a torchrun run after the current step with a
checkpoint, exit code 3 on every rank and no traceback from the ranks; ``--resume`` then replays
an uninterrupted run exactly. ``training.max_wall_minutes`` stops the same way. A second signal
exits at once."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_grpo.train.stop import STOP_EXIT_CODE, Stopped, StopRequest, launch_command
from tests.dist_utils import free_port, free_ports

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny.yaml"
SMALL = [
    "rollout.num_prompts=4",
    "rollout.group_size=4",
    "training.micro_batch_size=4",
    "logging.progress_bar=false",
]


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _torchrun(
    run: Path, steps: int, *extra: str, resume: bool = False, port: int | None = None
) -> subprocess.Popen:
    """The tiny recipe, shrunk, under torchrun (2 ranks, TP = 2); each rank's output also goes
    to ``run/logs`` (``--tee``), so the ranks' own output can be told from torchrun's."""
    port = free_port() if port is None else port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(port), "--log-dir", str(run / "logs"), "--tee", "3"]
    cmd += ["-m", "megatron_grpo.train", "--config", str(RECIPE)]
    sets = [*SMALL, f"training.steps={steps}", f"logging.dir={run}"]
    sets += [f"checkpoint.dir={run / 'ckpt'}", *extra]
    cmd += [a for s in sets for a in ("--set", s)] + (["--resume"] if resume else [])
    run.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=open(run / "console.txt", "a"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal job would be
    )


def _wait_for_steps(proc: subprocess.Popen, metrics: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _lines(metrics) < n:
        assert proc.poll() is None, f"the run ended before step {n}: rc {proc.returncode}"
        assert time.monotonic() < deadline, f"no step {n} after {timeout} s"
        time.sleep(0.05)


def _workers(proc: subprocess.Popen) -> list[int]:
    """torchrun's worker pids (its child processes)."""
    kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(kids) == 2, kids
    return [int(k) for k in kids]


def _rank_output(run: Path) -> dict[int, str]:
    """Each rank's stdout + stderr, from torchrun's ``--log-dir``."""
    out = {}
    for rank in (0, 1):
        files = sorted(run.glob(f"logs/*/attempt_0/{rank}/std*.log"))
        assert len(files) == 2, files
        out[rank] = "".join(f.read_text() for f in files)
    return out


def _check_stopped(run: Path, reason: str, rc: int, exit_codes_reported: bool) -> int:
    """The stop line, exit codes, checkpoint and output of a stopped torchrun run; returns the
    step it stopped after."""
    console = (run / "console.txt").read_text()
    ranks = _rank_output(run)
    for rank, text in ranks.items():
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, (rank, text[-3000:])
    lines = [line for line in ranks[0].splitlines() if line.startswith("stopped by")]
    assert len(lines) == 1 and not any("stopped by" in line for line in ranks[1].splitlines())
    step = _metrics(run / "metrics.jsonl")[-1]["step"]
    assert lines[0].startswith(f"stopped by {reason} after step {step}: saved checkpoint ")
    assert (
        lines[0].endswith("--resume") and "resume with: torchrun --nproc-per-node 2 -m " in lines[0]
    )
    assert (run / "ckpt" / "latest").read_text().strip() == f"step_{step:08d}"
    # torchrun exits 1 when a worker exits non-zero (its own ChildFailedError report) or when
    # it was signalled itself (its SignalException); the ranks' code is in its report.
    assert rc == 1, console[-3000:]
    if exit_codes_reported:
        assert console.count(f"exitcode  : {STOP_EXIT_CODE} (pid:") == 2, console[-3000:]
    assert not list((run / "ckpt").glob(".tmp_*"))
    return step


@pytest.fixture(scope="module")
def sigterm_runs(tmp_path_factory) -> dict:
    """A run stopped by SIGTERM to every rank after step 3 or later, then its ``--resume`` to
    two steps past the stop and, side by side (its own directory and port), an uninterrupted
    reference run from step 1. Once the reference has logged those steps it serves the
    one-rank test too: a signal to its rank 1 (saves a launch of its own)."""
    root = tmp_path_factory.mktemp("sigterm")
    stopped, reference = root / "stopped", root / "reference"
    proc = _torchrun(stopped, 1000)
    _wait_for_steps(proc, stopped / "metrics.jsonl", 3)
    for pid in _workers(proc):
        os.kill(pid, signal.SIGTERM)
    rc = proc.wait(timeout=120)
    try:  # the stop's checks (the first test's) before the resume adds to the directory
        stop: int | AssertionError = _check_stopped(stopped, "SIGTERM", rc, True)
    except AssertionError as e:
        stop = e
    total = _metrics(stopped / "metrics.jsonl")[-1]["step"] + 2
    resume_port, reference_port = free_ports(2)
    resumed = _torchrun(stopped, total, resume=True, port=resume_port)
    ref = _torchrun(reference, 1000, port=reference_port)
    try:  # steps 1..total uninterrupted, then the signal to one rank
        _wait_for_steps(ref, reference / "metrics.jsonl", total, timeout=180)
        os.kill(_workers(ref)[1], signal.SIGUSR1)
    except BaseException:
        os.killpg(ref.pid, signal.SIGKILL)  # torchrun's own process group, ranks included
        raise
    finally:
        resumed_rc, reference_rc = resumed.wait(timeout=180), ref.wait(timeout=120)
    return dict(root=root, stop=stop, total=total, resumed=resumed_rc, ref=reference_rc)


@pytest.mark.slow
def test_sigterm_to_every_rank_saves_exits_3_and_resume_replays_exactly(sigterm_runs):
    stopped, total = sigterm_runs["root"] / "stopped", sigterm_runs["total"]
    step = sigterm_runs["stop"]  # _check_stopped(stopped, "SIGTERM", rc, True) before resuming
    if isinstance(step, AssertionError):
        raise step
    assert 3 <= step < 1000 and total == step + 2
    assert sigterm_runs["resumed"] == 0
    # the reference's first ``total`` steps (the signal to one rank came after them)
    full, part = (
        _metrics(sigterm_runs["root"] / "reference" / "metrics.jsonl")[:total],
        _metrics(stopped / "metrics.jsonl"),
    )
    assert [m["step"] for m in full] == list(range(1, total + 1))
    assert [m["step"] for m in part] == list(range(1, total + 1))
    for a, b in zip(full, part, strict=True):
        timeless = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in (a, b)]
        assert timeless[0] == timeless[1], (a, b)


def test_a_signal_to_one_rank_stops_both(sigterm_runs):
    """The reference run of ``sigterm_runs`` (a fresh run, like any), SIGUSR1 to its rank 1."""
    reference, rc = sigterm_runs["root"] / "reference", sigterm_runs["ref"]
    step = _check_stopped(reference, "SIGUSR1", rc, exit_codes_reported=True)
    assert step >= sigterm_runs["total"]


def test_ctrl_c_to_the_process_group_saves(tmp_path):
    """A terminal's Ctrl-C: SIGINT to torchrun, the ranks and the ranks' helper processes;
    torchrun forwards it to each rank's process group once more (the same request)."""
    proc = _torchrun(tmp_path, 1000)
    _wait_for_steps(proc, tmp_path / "metrics.jsonl", 2)
    os.killpg(proc.pid, signal.SIGINT)
    _check_stopped(tmp_path, "SIGINT", proc.wait(timeout=120), exit_codes_reported=False)


def test_max_wall_minutes_saves_and_exits_3(tmp_path):
    """A world of one (plain python): the process's own exit code. 0.05 min is over once the
    first step has run (start-up alone takes longer), so it stops after step 1."""
    cmd = [sys.executable, "-m", "megatron_grpo.train", "--config", str(RECIPE)]
    sets = [*SMALL, "parallel.tensor_model_parallel_size=1", "training.steps=1000"]
    sets += [f"logging.dir={tmp_path}", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    sets += ["training.max_wall_minutes=0.05"]
    cmd += [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == STOP_EXIT_CODE, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    saved = tmp_path / "ckpt" / "step_00000001"
    resume = shlex.join(["python", *cmd[1:], "--resume"])
    assert line.startswith("stopped by the time limit (training.max_wall_minutes=0.05: "), line
    assert line.endswith(f"after step 1: saved checkpoint {saved}; resume with: {resume}"), line
    assert [m["step"] for m in _metrics(tmp_path / "metrics.jsonl")] == [1]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000001"


# ---------------------------------------------------------------------- units

_SCRIPT = """
import os, signal, sys, time
from megatron_grpo.train import stop
s = stop.StopRequest(["SIGTERM", "SIGINT"])
s.install()
{body}
"""


def _script(body: str) -> subprocess.CompletedProcess:
    code = _SCRIPT.format(body=textwrap.dedent(body))
    env = dict(os.environ, RANK="0")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_a_second_signal_exits_at_once_a_repeat_within_the_window_does_not():
    out = _script("""
        os.kill(os.getpid(), signal.SIGTERM)
        assert s.requested()
        os.kill(os.getpid(), signal.SIGTERM)  # within REPEAT_WINDOW_S: torchrun's copy
        print("still running", flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # another signal: at once
        time.sleep(5)
        print("not reached", flush=True)
    """)
    assert out.returncode == 128 + signal.SIGINT, out.stderr
    assert out.stdout == "still running\n" and "Traceback" not in out.stderr
    assert "SIGTERM received: stopping after the current step" in out.stderr
    assert "SIGINT received again: exiting at once, without saving" in out.stderr

    out = _script("""
        stop.REPEAT_WINDOW_S = 0.0
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached", flush=True)
    """)
    assert out.returncode == 128 + signal.SIGTERM and out.stdout == "", out.stderr


def test_after_the_stop_is_saved_signals_end_with_the_stop_code():
    out = _script("""
        s.complete()
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached", flush=True)
    """)
    assert out.returncode == STOP_EXIT_CODE and out.stdout == "", out.stderr
    # exiting(): ignored while the process shuts down (Python would restore SIG_DFL)
    out = _script("""
        s.exiting()
        os.kill(os.getpid(), signal.SIGTERM)
        sys.exit(3)
    """)
    assert out.returncode == STOP_EXIT_CODE and out.stderr == "", out.stderr


def test_handlers_are_restored_and_agree_reports_the_signal():
    previous = signal.getsignal(signal.SIGUSR1)
    stop = StopRequest(["SIGUSR1"])
    with stop.handling():
        assert stop.agree() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested() and stop.agree() == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_time_limit_counts_the_slowest_step_from_the_process_start():
    stop = StopRequest([], max_wall_minutes=1.0, started=time.time() - 59.0)
    assert stop.agree() is None  # no step measured yet: the first step always runs
    time.sleep(0.6)
    # 59.6 s elapsed is within the minute, but another 0.6 s step would not be
    reason = stop.agree()
    assert reason is not None and reason.startswith("the time limit (training.max_wall_minutes=1:")
    assert StopRequest([], None).agree() is None  # nothing to agree on: no collective


def test_stop_messages_and_the_resume_command(monkeypatch):
    argv = ["--config", "recipes/tiny.yaml", "--overwrite", "--set", "a.b=c d"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    resume = "torchrun --nproc-per-node 2 -m megatron_grpo.train --config recipes/tiny.yaml "
    resume += "--set 'a.b=c d' --resume"
    ck = Path("ck/step_00000031")
    assert Stopped("SIGTERM", 31, 0, ck, True, "ck").message(argv) == (
        f"stopped by SIGTERM after step 31: saved checkpoint {ck}; resume with: {resume}"
    )
    ck20 = Path("ck/step_00000020")
    assert Stopped("SIGINT", 20, 20, ck20, False, "ck").message(argv) == (
        f"stopped by SIGINT before step 21: latest checkpoint {ck20}; resume with: {resume}"
    )
    assert (
        Stopped("SIGINT", 0, 0, None, False, "ck")
        .message(argv)
        .startswith(
            "stopped by SIGINT before the first step: no checkpoint yet; start again with: torchrun "
        )
    )
    assert Stopped("SIGTERM", 5, 0, None, False, None).message(argv) == (
        "stopped by SIGTERM after step 5: nothing saved (checkpoint.dir is null), so it cannot "
        "be resumed"
    )
    monkeypatch.setenv("GROUP_WORLD_SIZE", "4")
    assert launch_command(argv).startswith("torchrun --nnodes 4 --nproc-per-node 2 ... -m ")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert launch_command(argv, True).startswith("python -m megatron_grpo.train --config ")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.exit_signals=[SIGKILL]", "training.exit_signals[0]: 'SIGKILL' is not one of"),
        ("training.exit_signals=SIGTERM", "training.exit_signals: expected a list"),
        ("training.exit_signals=[SIGINT,SIGINT]", "exit_signals lists SIGINT more than once"),
        ("training.max_wall_minutes=0", "max_wall_minutes must be positive"),
    ],
)
def test_config_errors_name_the_field(override, message):
    from megatron_grpo.config import ConfigError
    from megatron_grpo.train.config import load_train_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_train_config(RECIPE, [override])
    cfg = load_train_config(RECIPE, ["training.exit_signals=[]", "training.max_wall_minutes=90"])
    assert cfg.training.exit_signals == [] and cfg.training.max_wall_minutes == 90.0


_TEARDOWN = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from megatron_grpo.megatron import parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if sys.argv[1] == "blocks":  # a teardown that never returns, as NCCL's was seen to
        dist.destroy_process_group = lambda *a, **k: time.sleep(600)
    ok = parallel.shutdown_process_groups(timeout_s=1.0)
    print("ok" if ok else "blocked", dist.is_initialized(), flush=True)
    if not ok:
        os._exit(5)
    """
)


@pytest.mark.parametrize("mode", ["returns", "blocks"])
def test_a_blocked_process_group_teardown_does_not_hold_the_exit(mode):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", _TEARDOWN, mode], capture_output=True, text=True, timeout=120
    )
    if mode == "returns":
        assert (r.returncode, r.stdout.split()) == (0, ["ok", "False"]), r.stderr
        assert "teardown" not in r.stderr
    else:
        assert (r.returncode, r.stdout.split()) == (5, ["blocked", "True"]), r.stderr
        assert "teardown did not end within 1 s" in r.stderr
        assert time.monotonic() - t0 < 60


def _nccl_teardown_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    from megatron_grpo.megatron import parallel

    assert parallel.shutdown_process_groups(timeout_s=60.0)  # False: it failed or blocked
    assert not dist.is_initialized()


@pytest.mark.gpu
def test_gpu_nccl_teardown_runs_on_each_ranks_own_gpu():
    """2 GPUs: the teardown thread's barrier runs on the rank's GPU (a new thread starts on
    GPU 0: every rank's barrier named it, "Duplicate GPU detected" on 4 H100s)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from tests.dist_utils import run_distributed

    run_distributed(_nccl_teardown_body, 2, backend="nccl", timeout=120)


def test_a_second_signal_exits_at_once_and_releases_the_lock(tmp_path):
    """Issue 39: the immediate exit of a second signal is a handled end: the lock's record is
    emptied, so the next run reports no stale lock."""
    import subprocess
    import sys
    import textwrap

    from megatron_grpo.train import rundir

    code = textwrap.dedent(
        f"""
        import os, signal, time
        from megatron_grpo.train.rundir import acquire_lock
        from megatron_grpo.train.stop import StopRequest
        acquire_lock({str(tmp_path)!r})
        stop = StopRequest(["SIGUSR1", "SIGUSR2"], None)
        stop.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(60)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 128 + signal.SIGUSR2, out.stderr[-2000:]
    assert (tmp_path / rundir.LOCK_NAME).read_text() == ""
    assert rundir.acquire_lock(tmp_path) is None
    rundir.release_locks()
