"""A run directory belongs to one run: the writer lock, the previous-run check and ``--overwrite``.

A run writes into ``logging.dir`` (``config.yaml``, ``metrics.jsonl``), ``checkpoint.dir``
(``step_N/``, ``latest``) and optionally ``rollout.output_dir``. Before anything is written:

* ``logging.dir`` and ``checkpoint.dir`` get a lock file, ``.megatron_grpo.lock`` holding the
  writer's pid and host, locked with ``flock`` for the writer's lifetime. The kernel drops the lock when the
  process dies (even under ``kill -9``), so a lock file left behind is stale by construction: it
  is taken over, and the dead writer's pid is reported. A run that ends cleanly or through a
  handled error (bad input, a failed reward, a signal) empties its record
  (:func:`release_locks`), so the next one starts without that notice; an error exit also
  removes the lock files and empty directories it created. A live writer makes a second run
  refuse.
* a fresh run (no ``--resume``) refuses to start over a previous run's outputs (non-empty
  ``metrics.jsonl``, checkpoints, rollout files) unless ``--overwrite`` is given; only then are
  exactly those files deleted (never the directories, never anything we did not write).
* ``--resume`` needs a checkpoint: a missing or misspelled ``checkpoint.dir`` is an error.

Only global rank 0 touches the file system; the verdict is broadcast so every rank raises the
same error (no rank is left waiting in a collective).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import torch.distributed as dist

LOCK_NAME = ".megatron_grpo.lock"
# path -> open file object holding the flock; kept for the process's lifetime.
_HELD: dict[str, object] = {}
# What claiming created (lock files, directories, outermost last): removed again when the run
# ends on an error before writing anything else there (no empty run folders left behind).
_CREATED: list[Path] = []


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (another writer, a previous run, no checkpoint)."""


def acquire_lock(directory: str | Path) -> str | None:
    """Lock ``directory`` for this process. Returns a notice when a stale lock (a dead writer's)
    was taken over, else None; raises :class:`RunDirError` when a live process holds it.

    Re-entrant within one process (a second ``Trainer`` in the same script)."""
    directory = Path(directory)
    path = directory / LOCK_NAME
    key = str(path.resolve())
    if key in _HELD:
        return None
    _CREATED.extend(new_dirs(directory))
    directory.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        _CREATED.append(path)
    f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the process lifetime
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = _read_owner(path)
        f.close()
        raise RunDirError(
            f"{directory} is in use by another run ({owner}); wait for it to finish, stop it, "
            "or use another logging.dir / checkpoint.dir"
        ) from None
    previous = _read_owner(path) if path.stat().st_size else None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
    f.flush()
    _HELD[key] = f
    if previous is None:
        return None
    return (
        f"took over the stale lock {path} of a run that died without cleaning up (killed or "
        f"crashed: {previous})"
    )


def new_dirs(directory: Path) -> list[Path]:
    """The directories ``mkdir(parents=True)`` of ``directory`` would create, innermost first."""
    out = []
    for d in (directory, *directory.parents):
        if d.exists():
            break
        out.append(d)
    return out


def _read_owner(path: Path) -> str:
    try:
        owner = json.loads(path.read_text())
        return f"pid {owner['pid']} on {owner['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "owner unknown"


def release_locks(failed: bool = False) -> None:
    """Release every lock this process holds when its run ends, cleanly or through a handled
    error (bad input, a failed reward, a signal): the owner record is emptied first, so the next
    run starts without a stale-lock notice (a killed or crashed run keeps its record: the kernel
    drops the flock, and the next run reports whose it was). ``failed``: also remove the lock
    files and directories claiming created, where nothing else was written since."""
    for f in _HELD.values():
        f.seek(0)  # type: ignore[attr-defined]
        f.truncate()  # type: ignore[attr-defined]
        f.close()  # type: ignore[attr-defined]
    _HELD.clear()
    created = list(_CREATED)
    _CREATED.clear()
    if not failed:
        return
    locks = [p for p in created if p.name == LOCK_NAME]
    dirs = sorted(set(created) - set(locks), key=lambda p: len(p.absolute().parts), reverse=True)
    for p in [*locks, *dirs]:  # lock files first, then directories innermost first
        try:
            if p.name == LOCK_NAME:
                p.unlink()
            else:
                p.rmdir()  # only when empty
        except OSError:
            continue


def run_outputs(metrics_path: Path, ckpt_dir: str | None, rollout_dir: str | None) -> list[Path]:
    """The files and directories a previous run left that a fresh run would overwrite."""
    found: list[Path] = []
    if metrics_path.is_file() and metrics_path.stat().st_size > 0:
        found.append(metrics_path)
    if ckpt_dir is not None and Path(ckpt_dir).is_dir():
        root = Path(ckpt_dir)
        found += sorted(p for p in root.iterdir() if _is_checkpoint_entry(p.name))
    if rollout_dir is not None and Path(rollout_dir).is_dir():
        found += sorted(Path(rollout_dir).glob("rollouts_step*"))
    return found


def _is_checkpoint_entry(name: str) -> bool:
    return name in ("latest", "latest.tmp") or name.startswith(("step_", ".tmp_step_"))


def _remove(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def _describe(paths: list[Path], limit: int = 6) -> str:
    names = [str(p) for p in paths[:limit]]
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(names) + more


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def claim_run_dirs(
    metrics_path: Path,
    log_dir: str,
    ckpt_dir: str | None,
    rollout_dir: str | None,
    *,
    resume: bool,
    overwrite: bool,
) -> None:
    """Lock the run's directories and check them against ``resume`` / ``overwrite`` (module
    docstring). Call on every rank; all ranks raise the same :class:`RunDirError`."""
    verdict: list[str | None] = [None]
    notes: list[str] = []
    if _rank() == 0:
        try:
            notes = _claim(metrics_path, log_dir, ckpt_dir, rollout_dir, resume, overwrite)
        except RunDirError as e:
            verdict[0] = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise RunDirError(verdict[0])
    for note in notes:
        print(note, file=sys.stderr, flush=True)


def _claim(
    metrics_path: Path,
    log_dir: str,
    ckpt_dir: str | None,
    rollout_dir: str | None,
    resume: bool,
    overwrite: bool,
) -> list[str]:
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other; pass one of them")
    if resume:
        check_resumable(ckpt_dir)  # before locking: the lock would create a misspelled dir
    wanted = (log_dir, metrics_path.parent, ckpt_dir)  # rollout dirs stay plain file lists
    dirs = {str(Path(d).resolve()): d for d in wanted if d is not None}
    notes = [n for d in dirs.values() if (n := acquire_lock(d)) is not None]
    if resume:
        return notes
    previous = run_outputs(metrics_path, ckpt_dir, rollout_dir)
    if previous and not overwrite:
        # --resume only where there is a checkpoint to resume from
        can_resume = ckpt_dir is not None and any(p.parent == Path(ckpt_dir) for p in previous)
        resume_hint = (
            "Pass --resume to continue it, --overwrite" if can_resume else "Pass --overwrite"
        )
        new_dirs = "logging.dir and checkpoint.dir (--set logging.dir=... --set checkpoint.dir=...)"
        raise RunDirError(
            f"{log_dir} already holds a run ({_describe(previous)}). {resume_hint} to delete "
            f"those files and start over, or choose a new "
            f"{new_dirs if ckpt_dir is not None else 'logging.dir (--set logging.dir=...)'}"
        )
    if previous:
        _remove(previous)
        notes.append(f"--overwrite: removed the previous run's {_describe(previous)}")
    return notes


def check_resumable(ckpt_dir: str | None) -> None:
    """Raise :class:`RunDirError` unless ``ckpt_dir`` holds a complete checkpoint."""
    if ckpt_dir is None:
        raise RunDirError("--resume needs checkpoint.dir")
    pointer = Path(ckpt_dir) / "latest"
    if not pointer.is_file():
        why = "does not exist" if not Path(ckpt_dir).exists() else "has no 'latest' file"
        raise RunDirError(
            f"--resume: checkpoint.dir {ckpt_dir!r} {why}, so there is nothing to resume. "
            "Check the path, or start a new run without --resume"
        )
    target = Path(ckpt_dir) / pointer.read_text().strip()
    if not target.is_dir():
        raise RunDirError(f"--resume: {pointer} points to {target}, which does not exist")
