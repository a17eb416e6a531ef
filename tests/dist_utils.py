"""Spawn N gloo (CPU, default) or nccl (GPU) processes and run a test body in each.

Usage::

    def _body(rank, world_size, x):
        ...  # torch.distributed is initialized here

    def test_something():
        run_distributed(_body, 2, x)

Exceptions raised in any rank fail the test with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports, for launches side by side: all held open while picked."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


# Imported once by the fork server (third-party only: our modules read settings such as
# TRITON_INTERPRET when imported, and a test may set them).
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt"]


def _context():
    """How ranks start. Without CUDA: forked from a server that imported torch and
    megatron-core once (about 0.2 s a two-rank start on a 2-core machine, against 4-5 s for two
    fresh interpreters' imports; the server itself runs nothing, so no thread or device state is
    forked). Where CUDA is present: fresh interpreters (a fork after the driver's initialization
    is unsafe)."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable,
    args: tuple,
    errq,
    timeout: float,
    env: dict[str, str],
) -> None:
    # the caller's environment now, not the fork server's at its start
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    # A rank still running shortly before the parent's deadline prints where it waits (stderr:
    # the failing test's report) before it is terminated.
    faulthandler.dump_traceback_later(max(timeout - 10.0, 1.0), exit=False)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        errq.put((rank, traceback.format_exc()))
        # No teardown: NCCL's blocks while a peer is elsewhere (both ranks of a failed 2-GPU
        # test sat in destroy_process_group until the deadline); exiting frees the GPU.
        sys.stderr.flush()
        os._exit(1)
    _teardown()
    # The body passed. Exit without running C++ static destructors: a gloo group's threads torn
    # down at interpreter exit can abort a healthy process ("terminate called without an active
    # exception", exit code -6), which would fail a test whose body passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _teardown() -> None:
    """Drop Megatron's cached groups (when it was used) and destroy every process group."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and dist.is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 600
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    The default backend is gloo (CPU tensors), also on GPU machines; GPU tests pass "nccl".
    When a rank fails, the others (possibly blocked in a collective) are terminated shortly
    after; the whole run is bounded by ``timeout`` seconds.
    """
    ctx = _context()
    errq = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, backend, fn, args, errq, timeout, env)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 20:
            break  # a peer failed: the survivors are stuck in a collective
        time.sleep(0.05)
    timed_out = any(p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join()
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    if errors:
        rank, tb = sorted(errors)[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if timed_out and failed_at is None:
        raise AssertionError(f"distributed test timed out after {timeout:.0f} s")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"worker exit codes {bad}")
