"""megatron-core's checkpoint writer results queue, served by a process that dies with us.

``dist_checkpointing``'s file writer (``filesystem_async._get_write_results_queue``) creates a
``multiprocessing`` Manager process on the first save and keeps it for the worker's lifetime.
Nothing ends that process when the worker is killed with -9: it lingered, ~270 MB each. We
install the same queue, served by a Manager whose process asks Linux for SIGKILL when its
parent dies (``PR_SET_PDEATHSIG``). Elsewhere the plain Manager is used, as before.

This module imports nothing heavy: it is what the Manager process itself imports.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import signal
import sys
from multiprocessing.managers import SyncManager

_PR_SET_PDEATHSIG = 1
_MANAGERS: list[SyncManager] = []  # keeps the manager (and its queue) alive


def die_with_parent() -> None:
    """Manager-process initializer: be killed when the parent process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass


def install_writer_queue() -> None:
    """Give megatron-core's writer a results queue whose server dies with this process."""
    from megatron_grpo.megatron.compat import set_checkpoint_results_queue

    set_checkpoint_results_queue(_dying_manager_queue)


def _dying_manager_queue():
    """A queue served by a Manager process that dies with this one."""
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent)
    _MANAGERS.append(manager)
    return manager.Queue()
