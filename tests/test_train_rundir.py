"""A run directory belongs to one run: a second live writer is refused, a stale lock is taken
over, a fresh run refuses a previous run's outputs unless --overwrite, --resume needs a
checkpoint, pruning touches only this run's checkpoints, and a torn metrics line is dropped."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_grpo.train import rundir
from megatron_grpo.train.rundir import RunDirError, acquire_lock, claim_run_dirs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_held_locks():
    yield
    rundir.release_locks()


def _holder(directory: Path) -> subprocess.Popen:
    """Another process that takes the lock of ``directory`` and keeps it until killed."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from megatron_grpo.train.rundir import acquire_lock
        acquire_lock({str(directory)!r})
        print("locked", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_concurrent_writer_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunDirError, match=f"in use by another run \\(pid {proc.pid} "):
            acquire_lock(tmp_path)
    finally:
        proc.kill()  # like kill -9: the lock file stays behind
        proc.wait()
    notice = acquire_lock(tmp_path)
    assert (
        notice is not None and f"pid {proc.pid}" in notice and "died without cleaning up" in notice
    )
    owner = json.loads((tmp_path / rundir.LOCK_NAME).read_text())
    assert owner["pid"] != proc.pid
    assert acquire_lock(tmp_path) is None  # re-entrant in one process


def test_a_clean_release_leaves_no_stale_notice(tmp_path):
    """A run that ends cleanly empties its owner record: the next run takes the lock silently
    (the stale notice is for writers that died)."""
    assert acquire_lock(tmp_path) is None
    rundir.release_locks()
    assert (tmp_path / rundir.LOCK_NAME).read_text() == ""
    assert acquire_lock(tmp_path) is None
    rundir.release_locks()


def _previous_run(tmp: Path) -> tuple[Path, Path]:
    metrics = tmp / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    ckpt = tmp / "checkpoints"
    (ckpt / "step_00000002").mkdir(parents=True)
    (ckpt / "latest").write_text("step_00000002\n")
    return metrics, ckpt


def _claim(tmp: Path, ckpt: Path | str | None, **kw) -> None:
    claim_run_dirs(tmp / "metrics.jsonl", str(tmp), None if ckpt is None else str(ckpt), None, **kw)


def test_no_resume_suggestion_without_a_checkpoint(tmp_path):
    """A run without checkpoint.dir cannot be resumed: the refusal offers --overwrite only."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError, match="already holds a run") as err:
        _claim(tmp_path, None, resume=False, overwrite=False)
    assert "--resume" not in str(err.value) and "--overwrite" in str(err.value)
    assert "checkpoint.dir" not in str(err.value)
    rundir.release_locks()


def test_fresh_run_over_a_previous_run_refuses_unless_overwrite(tmp_path):
    metrics, ckpt = _previous_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="already holds a run .*--resume.*--overwrite"):
        _claim(tmp_path, ckpt, resume=False, overwrite=False)
    assert metrics.read_text().count("\n") == 2 and (ckpt / "step_00000002").is_dir()
    _claim(tmp_path, ckpt, resume=False, overwrite=True)
    assert not metrics.exists() and not (ckpt / "latest").exists()
    assert not (ckpt / "step_00000002").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"  # not ours: never deleted
    _claim(tmp_path, ckpt, resume=False, overwrite=False)  # now empty: a fresh run may start


def test_resume_without_a_checkpoint_is_an_error_and_keeps_the_metrics(tmp_path):
    metrics, ckpt = _previous_run(tmp_path)
    typo = tmp_path / "checkpoint"
    with pytest.raises(RunDirError, match="does not exist, so there is nothing to resume"):
        _claim(tmp_path, typo, resume=True, overwrite=False)
    assert not typo.exists()  # the misspelled directory is not created
    (typo).mkdir()
    with pytest.raises(RunDirError, match="has no 'latest' file"):
        _claim(tmp_path, typo, resume=True, overwrite=False)
    with pytest.raises(RunDirError, match="needs checkpoint.dir"):
        _claim(tmp_path, None, resume=True, overwrite=False)
    (ckpt / "latest").write_text("step_00000009\n")
    with pytest.raises(RunDirError, match="which does not exist"):
        _claim(tmp_path, ckpt, resume=True, overwrite=False)
    assert metrics.read_text().count("\n") == 2
    (ckpt / "latest").write_text("step_00000002\n")
    _claim(tmp_path, ckpt, resume=True, overwrite=False)
    with pytest.raises(RunDirError, match="contradict"):
        _claim(tmp_path, ckpt, resume=True, overwrite=True)


def test_pruning_keeps_latest_and_never_touches_higher_steps(tmp_path):
    from megatron_grpo.train.checkpoint import _prune

    for step in (10, 20, 40, 60):
        (tmp_path / f"step_{step:08d}").mkdir()
    (tmp_path / ".tmp_step_00000020").mkdir()
    (tmp_path / ".tmp_step_00000080").mkdir()
    _prune(tmp_path, tmp_path / "step_00000020", keep_last=1)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".tmp_step_00000080", "step_00000020", "step_00000040", "step_00000060"]


def test_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    from megatron_grpo.train.monitor import truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    truncate_jsonl(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert f"{path}:3: dropped a torn last line" in capsys.readouterr().err
    path.write_text('{"step": 1}\ngarbage\n{"step": 2}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not a metrics line"):
        truncate_jsonl(path, 2)


RECIPE = ROOT / "recipes" / "tiny.yaml"


def _twice_body(rank: int, world: int, tmp: Path) -> None:
    """The quick start twice in one directory (world of one, shrunk): the second fresh run
    refuses and leaves the first intact; --resume with a misspelled dir refuses; --overwrite
    starts over with complete metrics and a valid ``latest``; a truncated shard is named."""
    from megatron_grpo.train import checkpoint as ckpt
    from megatron_grpo.train.__main__ import main
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.trainer import Trainer

    run, ck = tmp / "tiny", tmp / "tiny" / "checkpoints"
    common = [
        "parallel.tensor_model_parallel_size=1", "rollout.num_prompts=2",
        "rollout.group_size=2", "training.micro_batch_size=4", "logging.progress_bar=false",
        f"logging.dir={run}", "checkpoint.save_interval=1", "checkpoint.keep_last=1",
    ]  # fmt: skip

    def cfg(steps: int, ckpt_dir: Path = ck):
        extra = [f"training.steps={steps}", f"checkpoint.dir={ckpt_dir}"]
        return load_train_config(RECIPE, common + extra)

    def steps_logged() -> list[int]:
        return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]

    Trainer(cfg(2)).train()
    assert steps_logged() == [1, 2] and ckpt.latest_checkpoint(ck).name == "step_00000002"
    with pytest.raises(RunDirError, match="already holds a run"):
        Trainer(cfg(3))
    with pytest.raises(RunDirError, match="nothing to resume"):
        Trainer(cfg(3, tmp / "tiny" / "checkpoint"), resume=True)
    assert steps_logged() == [1, 2] and ckpt.latest_checkpoint(ck).name == "step_00000002"
    Trainer(cfg(3), overwrite=True).train()
    assert steps_logged() == [1, 2, 3]
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000003"]
    assert ckpt.latest_checkpoint(ck).name == "step_00000003"
    shard = sorted((ck / "step_00000003").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(ckpt.CheckpointError, match=f"step_00000003 is damaged: {shard.name}: "):
        Trainer(cfg(4), resume=True)
    assert steps_logged() == [1, 2, 3]
    bad = tmp / "bad.jsonl"  # 2 groups of 2; line 4 holds an id beyond the vocabulary
    rows = [[3, 4], [3, 4], [3, 4], [3, 999]]
    bad.write_text("".join(_rollout_line(r, i // 2) for i, r in enumerate(rows)))
    file_run = [f"rollout.input_path={bad}", "checkpoint.dir=null", f"logging.dir={tmp / 'f'}"]
    with pytest.raises(ValueError, match=f"{bad}:4: response_ids\\[1\\] = 999 is not below"):
        Trainer(load_train_config(RECIPE, common + ["training.steps=1", *file_run]))
    argv = ["--config", str(RECIPE), "--resume"] + [f"--set={o}" for o in common]
    assert main(argv + [f"--set=checkpoint.dir={tmp / 'nope'}"]) == 2  # a refusal, no traceback
    assert steps_logged() == [1, 2, 3]


def _rollout_line(response: list[int], group: int) -> str:
    row = {"prompt_ids": [11, 1, 2, 10], "response_ids": response, "group_id": group}
    return json.dumps({**row, "reward": 1.0}) + "\n"


@pytest.mark.slow
def test_quick_start_twice_in_one_directory(tmp_path):
    from tests.dist_utils import run_distributed

    run_distributed(_twice_body, 1, tmp_path)


def test_empty_checkpoint_dir_and_yaml_syntax_errors_are_config_errors(tmp_path, capsys):
    from megatron_grpo.train.__main__ import main

    assert main(["--config", str(RECIPE), "--set", "checkpoint.dir="]) == 2
    assert "dir is an empty path (null disables checkpoints)" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  steps: 3\n  seed: [1, 2\nlogging: {}\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4:" in err and "YAML syntax error" in err and "Traceback" not in err


def test_plain_python_runs_bind_no_port(tmp_path):
    """Two plain-python runs used to collide on a hard-coded port; now none is bound."""
    import os
    import socket

    code = (
        "import torch.distributed as d\n"
        "from megatron_grpo.megatron.parallel import _init_process_group\n"
        "_init_process_group(1)\n"
        "print(d.get_world_size(), d.get_rank())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_PORT", "WORLD_SIZE")}
    with socket.socket() as busy:  # the port the old code always used
        busy.bind(("127.0.0.1", 29511))
        busy.listen()
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["1", "0"]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_checkpoint_writer_queue_process_dies_with_a_killed_worker():
    import signal
    import time

    code = (
        "import time\n"
        "from megatron_grpo.train import writer_queue as wq\n"
        "wq.install_writer_queue()\n"
        "print(wq._MANAGERS[0]._process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    manager = int(proc.stdout.readline())
    assert _alive(manager)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(manager) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(manager), f"the writer queue's manager (pid {manager}) outlived its worker"


def test_summary_of_a_resumed_finished_run_says_it_is_complete():
    from megatron_grpo.train.__main__ import _summary
    from megatron_grpo.train.config import load_train_config

    cfg = load_train_config(RECIPE, ["training.steps=60", "checkpoint.dir=null"])
    assert _summary(cfg, 20, 3.0).startswith("done: steps 21..60 in 3 s")
    done = _summary(cfg, 60, 1.0)
    assert "already complete at step 60 of training.steps=60" in done and "61" not in done


def test_a_failed_run_releases_its_lock_and_leaves_no_empty_folders(tmp_path):
    """Issue 39: a handled error exit releases the lock (no stale-lock notice next time) and
    removes what claiming created (lock files, empty directories); a directory that existed
    keeps everything but the empty record."""
    existing = tmp_path / "logs"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    new_ckpt = tmp_path / "a" / "b" / "checkpoints"
    metrics = existing / "metrics.jsonl"
    claim_run_dirs(metrics, str(existing), str(new_ckpt), None, resume=False, overwrite=False)
    assert (new_ckpt / rundir.LOCK_NAME).is_file()
    rundir.release_locks(failed=True)
    assert not (tmp_path / "a").exists()
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]
    assert acquire_lock(existing) is None  # released: no stale-lock notice
