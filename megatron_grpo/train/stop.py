"""Stopping a run cleanly: on a signal (``training.exit_signals``) or before a wall-time budget
(``training.max_wall_minutes``) runs out.

A signal handler only records the signal. Every rank calls :meth:`StopRequest.agree` at the same
point of each step: before the step starts, so right after the previous one and its save. There
one all-reduce (MAX over the world) of a small code spreads one rank's request to all ranks: a
signal sent to a single rank stops every rank at the same step boundary, and no collective is
added inside a step. The step in progress when a signal arrives is finished (never abandoned
halfway: its collectives must run on every rank), so the stop waits at most for the rest of that
step. The trainer then saves through its normal checkpoint path and the entry point exits with
:data:`STOP_EXIT_CODE` after one line that names the checkpoint and the command that resumes.

A second signal exits at once (``os._exit``, nothing saved, exit code ``128 + signal``), except:

* the same signal again within :data:`REPEAT_WINDOW_S` counts as the first one: ``torchrun``
  forwards the SIGINT/SIGTERM it receives to its workers, so a Ctrl-C in a terminal, or a
  scheduler that signals every process of the job, reaches each rank twice within milliseconds;
* once the stop's checkpoint is written, any further signal exits at once with
  :data:`STOP_EXIT_CODE` (nothing is left to lose; ``torchrun`` sends SIGTERM to the ranks still
  running when the first one has exited).

Time budget: the run stops when the time since this process started plus the slowest step so far
(measured between two agreements, so a save in that step counts) would exceed
``max_wall_minutes``. The first step of a process always runs: there is no step time to predict
with before it.

Imports nothing heavy (torch.distributed only): the entry point installs the handlers before
Megatron is imported.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

STOP_EXIT_CODE = 3
DEFAULT_EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
# The same signal again within this many seconds is the same request (torchrun's forwarded copy).
REPEAT_WINDOW_S = 2.0
# agree()'s codes, reduced with MAX: a signal (100 + its number) wins over the time limit.
_TIME_LIMIT = 1
_SIGNAL_BASE = 100


def process_start_time() -> float:
    """``time.time()`` at which this process started (Linux ``/proc``; elsewhere: now)."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - int(stat[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start, in ticks
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return time.time()


def _write(text: str) -> None:
    """Write from a signal handler: straight to fd 2 (``print`` may be mid-write already); on a
    terminal after a line break (the progress line is redrawn in place)."""
    with contextlib.suppress(OSError):
        os.write(2, (("\n" if os.isatty(2) else "") + text + "\n").encode())


class StopRequest:
    """A request to stop between steps, from a signal or the wall-time budget (module docstring).

    ``install()`` the handlers (main thread only), call ``agree()`` on every rank once per step,
    and ``complete()`` once the stop's checkpoint is written. ``reason`` is the agreed reason
    (``"SIGTERM"``, ``"the time limit ..."``) or None.
    """

    def __init__(
        self,
        signals: Sequence[str] = DEFAULT_EXIT_SIGNALS,
        max_wall_minutes: float | None = None,
        started: float | None = None,
    ) -> None:
        # A name this platform lacks (SIGUSR1 on Windows) is skipped.
        self.signals = [signal.Signals[name] for name in signals if hasattr(signal, name)]
        self.max_wall_minutes = max_wall_minutes
        self.started = process_start_time() if started is None else started
        self.reason: str | None = None
        # Whether this rank prints the receipt notice (the trainer sets its logging rank).
        self.announce = os.environ.get("RANK", "0") == "0"
        self._received: signal.Signals | None = None
        self._received_at = 0.0
        self._completed = False
        self._previous: dict[signal.Signals, Any] = {}
        self._last_agree: float | None = None
        self._slowest_step = 0.0

    @classmethod
    def from_config(cls, training: Any) -> StopRequest:
        """From ``TrainingConfig`` (``exit_signals``, ``max_wall_minutes``)."""
        return cls(training.exit_signals, training.max_wall_minutes)

    # ------------------------------------------------------------------ handlers
    def install(self) -> bool:
        """Handle the signals; True when this call installed them (False: already installed, or
        not the main thread, where Python cannot install handlers)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return bool(self._previous)

    def uninstall(self) -> None:
        """Restore the handlers that :meth:`install` replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @contextlib.contextmanager
    def handling(self) -> Iterator[StopRequest]:
        """Handlers installed for the block, unless someone (the entry point) already did."""
        installed = self.install()
        try:
            yield self
        finally:
            if installed:
                self.uninstall()

    @contextlib.contextmanager
    def shielding_children(self) -> Iterator[None]:
        """Processes started in the block inherit the exit signals blocked: pending, never acted
        on. ``torchrun`` signals a worker's whole process group, and a terminal or a scheduler
        may signal every process, which would kill a helper (the checkpoint writer's queue
        server) before the stop's save. Here, a signal that arrives meanwhile is handled when
        the block ends. multiprocessing's resource tracker is started first: its start unblocks
        SIGINT and SIGTERM (to start the tracker itself with them blocked)."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        now = time.monotonic()
        if self._completed:
            _exit(STOP_EXIT_CODE)
        if self._received is None:
            self._received, self._received_at = sig, now
            if self.announce:
                _write(
                    f"{sig.name} received: stopping after the current step (with a checkpoint "
                    f"when checkpoint.dir is set); another signal, {REPEAT_WINDOW_S:g} s or more "
                    "later, exits at once without saving"
                )
            return
        if sig == self._received and now - self._received_at < REPEAT_WINDOW_S:
            return  # the same request again: torchrun forwarded the signal it received too
        if self.announce:
            _write(f"{sig.name} received again: exiting at once, without saving")
        _exit(128 + signum)

    # ------------------------------------------------------------------ the decision
    def requested(self) -> bool:
        """Whether this rank received a stop signal (not yet agreed with the other ranks)."""
        return self._received is not None

    def agree(self) -> str | None:
        """The reason to stop that every rank now shares, or None. A collective over the whole
        world: every rank calls it at the same point of each step (none when there is nothing
        to agree on: no exit signals and no time limit, the same on every rank)."""
        if not self.signals and self.max_wall_minutes is None:
            return None
        now = time.monotonic()
        if self._last_agree is not None:
            self._slowest_step = max(self._slowest_step, now - self._last_agree)
        self._last_agree = now
        local = 0
        if self._received is not None:
            local = _SIGNAL_BASE + int(self._received)
        elif self._out_of_time():
            local = _TIME_LIMIT
        code = local
        if dist.is_initialized():
            from megatron_grpo.train import comm  # imports Megatron: only once training runs

            code = int(comm.all_reduce_max([float(local)])[0])
        if code and self.reason is None:
            self.reason = self._describe(code)
        return self.reason

    def _out_of_time(self) -> bool:
        if self.max_wall_minutes is None or self._slowest_step == 0.0:
            return False
        return time.time() - self.started + self._slowest_step > 60.0 * self.max_wall_minutes

    def _describe(self, code: int) -> str:
        if code >= _SIGNAL_BASE:
            return signal.Signals(code - _SIGNAL_BASE).name
        elapsed = (time.time() - self.started) / 60.0
        return (
            f"the time limit (training.max_wall_minutes={self.max_wall_minutes:g}: {elapsed:.1f} "
            f"min elapsed, a step takes up to {self._slowest_step / 60.0:.2f} min)"
        )

    def complete(self) -> None:
        """The stop's checkpoint is written: a further signal exits at once with
        :data:`STOP_EXIT_CODE`."""
        self._completed = True

    def exiting(self) -> None:
        """The process exits with :data:`STOP_EXIT_CODE` next: ignore the signals from now on.
        ``torchrun`` signals the ranks still running once one has exited, and Python restores
        the default handlers when it shuts down (ignored signals stay ignored), so a rank a
        moment slower than the others would otherwise die by that signal instead. For the entry
        point only: :meth:`uninstall` then leaves the signals ignored."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                signal.signal(sig, signal.SIG_IGN)
            self._previous.clear()


@dataclass
class Stopped:
    """How a stopped run ended: ``after_step`` steps done (``first_step`` = the step this process
    started at), ``checkpoint`` = the newest checkpoint (None: none), ``saved_now`` = whether this
    stop wrote it, ``checkpoint_dir`` = ``checkpoint.dir``."""

    reason: str
    after_step: int
    first_step: int
    checkpoint: Path | None
    saved_now: bool
    checkpoint_dir: str | None

    def message(self, argv: Sequence[str]) -> str:
        """The one line: why, after which step, what was saved, the command that continues."""
        if self.after_step > self.first_step:
            when = f"after step {self.after_step}"
        elif self.after_step == 0:
            when = "before the first step"
        else:
            when = f"before step {self.after_step + 1}"
        head = f"stopped by {self.reason} {when}"
        if self.checkpoint_dir is None:
            return f"{head}: nothing saved (checkpoint.dir is null), so it cannot be resumed"
        if self.checkpoint is None:
            return f"{head}: no checkpoint yet; start again with: {launch_command(argv)}"
        saved = "saved checkpoint" if self.saved_now else "latest checkpoint"
        return f"{head}: {saved} {self.checkpoint}; resume with: {launch_command(argv, True)}"


def launch_command(argv: Sequence[str], resume: bool = False) -> str:
    """This run's command line (the launcher from torchrun's environment), with ``--resume``
    instead of ``--overwrite`` when ``resume``."""
    args = [a for a in argv if a not in ("--resume", "--overwrite")]
    if resume:
        args.append("--resume")
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in os.environ or local is None:
        launcher = ["python"]
    elif nodes > 1:
        launcher = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", local, "..."]
    else:
        launcher = ["torchrun", "--nproc-per-node", local]
    return shlex.join([*launcher, "-m", "megatron_grpo.train", *args])


def _exit(code: int) -> None:
    """``os._exit`` from a signal: a handled end, so the run's locks are released first (the
    next run gets no stale-lock notice)."""
    from megatron_grpo.train.rundir import release_locks

    release_locks()
    os._exit(code)
