"""Process groups and RNG seeding for Megatron-Core, on GPU (nccl) and CPU (gloo).

megatron-core's ``model_parallel_cuda_manual_seed`` and its RNG tracker read and write CUDA
generator states, so on a CPU-only machine every ``get_cuda_rng_tracker().fork()`` (dropout in
tensor-parallel regions, GPU-style initialization, sequence-parallel blocks) would fail. On CPU
we install :class:`~megatron_grpo.megatron.compat.CpuRNGStatesTracker`, the same tracker over CPU generator states, seeded
exactly like Megatron's (data-parallel seed, TP seed ``seed + 2718 + tp_rank``, expert seed
``seed + 1024 + 100 * ep_rank + etp_rank``). Activation recomputation also saves CUDA RNG state
and is therefore GPU-only.

megatron-core also places buffers with ``device=torch.cuda.current_device()`` at run time (DDP
gradient buffers, RoPE frequencies, MoE routing maps). On a host without CUDA that call can only
raise, so :func:`redirect_cuda_device_to_cpu` makes it return the CPU device there; on GPU hosts
nothing is changed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import sys
import threading
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from torch.overrides import TorchFunctionMode

from megatron_grpo.megatron.compat import install_cpu_rng_tracker, reset_rng_tracker
from megatron_grpo.megatron.config import ParallelConfig
from megatron_grpo.megatron.layout import ParallelLayout


def comm_device() -> torch.device:
    """Where tensors for collectives live: NCCL communicates device tensors only."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """Sum float64 scalars over ``group`` (None = world); the values themselves without
    torch.distributed."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def all_reduce_max(
    values: list[float], group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float64
) -> list:
    """Element-wise max of scalars over ``group`` (None = world) in ``dtype`` (``torch.int64``
    for counts: exact at any size, ints back); the values themselves without torch.distributed.
    The one all-reduce-max of the package (the trainer's, batching's and the engines')."""
    t = torch.tensor(values, dtype=dtype, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def redirect_cuda_device_to_cpu() -> None:
    """On a CUDA-less host, make ``torch.cuda.current_device()`` return the CPU device.

    Only affects a call that would otherwise raise "Torch not compiled with CUDA enabled"/"no
    CUDA GPUs"; with CUDA available this is a no-op.
    """
    if torch.cuda.is_available() or getattr(torch.cuda.current_device, "_grpo_cpu", False):
        return

    def current_device() -> torch.device:
        return torch.device("cpu")

    current_device._grpo_cpu = True  # type: ignore[attr-defined]
    torch.cuda.current_device = current_device  # type: ignore[assignment]


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_ISSUED: set[tuple] = set()


def _call_attributed(func, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` for a tensor subclass, its warnings re-issued at the code that
    made the torch call: a subclass's ``__torch_function__`` (torch's deprecated ShardedTensor,
    which dist-checkpoint loads touch) warns at its caller, which would be this mode's frame
    rather than the third-party file that ``WarningLog`` sends to ``warnings.log``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = func(*args, **kwargs)
    caller = sys._getframe(2)  # 0: here, 1: __torch_function__, 2: the torch call's site
    for w in caught:
        here = w.filename == __file__
        site = (caller.f_code.co_filename, caller.f_lineno) if here else (w.filename, w.lineno)
        key = (*site, w.category, str(w.message))
        if key not in _ISSUED:  # once per site (catch_warnings resets the usual registries)
            _ISSUED.add(key)
            warnings.warn_explicit(w.message, w.category, *site)
    return result


class _CudaOnCpu(TorchFunctionMode):
    """Tensors asked for on ``device="cuda"`` (or moved with ``.cuda()``) stay on the CPU, and
    ``tensor.type()`` reports CUDA type names (megatron-core's gradient clipping and distributed
    optimizer assert ``grad.type() == 'torch.cuda.FloatTensor'``; their arithmetic is
    device-agnostic).

    Only used on CUDA-less hosts, where those calls could only raise.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        to_cpu = device is not None and torch.device(device).type == "cuda"
        if not to_cpu and func not in (torch.Tensor.cuda, torch.Tensor.type):
            if any(t not in _PLAIN_TENSORS for t in types):
                return _call_attributed(func, args, kwargs)
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **{**kwargs, "device": "cpu"} if to_cpu else kwargs)


@contextlib.contextmanager
def cuda_compat() -> Iterator[None]:
    """Run megatron-core code that hard-codes CUDA on a CUDA-less host.

    The pipeline schedules create their token counter with ``device="cuda"`` and call
    ``torch.cuda.synchronize()``; tied embeddings under PP call ``.cuda()``; the optimizer checks
    CUDA type names. Inside this context
    such tensors stay on the CPU and the synchronize is a no-op. On GPU hosts it does nothing.
    """
    if torch.cuda.is_available():
        yield
        return
    redirect_cuda_device_to_cpu()
    sync = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        with _CudaOnCpu():
            yield
    finally:
        torch.cuda.synchronize = sync  # type: ignore[assignment]


def _init_process_group(timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:
        # A plain `python` run: a world of one over an in-process store, so no TCP port is
        # bound and any number of such runs can share a host.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if backend == "nccl":
            torch.cuda.set_device(0)
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    else:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        dist.init_process_group(backend, timeout=timeout)
    if backend == "gloo":
        # A gloo group left alive at interpreter exit can abort the process ("terminate called
        # without an active exception") as its threads are torn down. Not for NCCL: destroying
        # a communicator with collectives in flight (a rank failing) can block, where exiting
        # lets torchrun stop the job.
        atexit.register(_destroy_process_group_at_exit)


def _destroy_process_group_at_exit() -> None:
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# A healthy barrier + teardown takes seconds even with hundreds of groups.
TEARDOWN_TIMEOUT_S = 30.0


def shutdown_process_groups(timeout_s: float = TEARDOWN_TIMEOUT_S) -> bool:
    """Line the ranks up and destroy every process group; False when that did not end within
    ``timeout_s`` seconds (or failed: a peer died), after one line on stderr.

    NCCL's communicator teardown can block for good when the ranks do not reach it together,
    and was seen to block at the end of a clean 2-GPU run (torch 2.11, CUDA 13). The teardown
    runs in a daemon thread, so a caller whose teardown blocks can still exit (``os._exit``
    with its own exit code); the driver frees the GPUs with the process.
    """
    if not dist.is_initialized():
        return True
    failed: list[BaseException] = []
    # The CUDA device is per thread and a new thread starts on device 0: without this every
    # rank's barrier named GPU 0 ("Duplicate GPU detected", or a hang on 4 H100s).
    device = torch.cuda.current_device() if dist.get_backend() == "nccl" else None

    def teardown() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
                torch.cuda.synchronize()
                dist.barrier(device_ids=[device])
            # Megatron's cached groups first: a group object alive at interpreter exit is torn
            # down with its threads there, which can abort a finished run (exit code -6)
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        except BaseException as e:  # reported below; the caller exits either way
            failed.append(e)

    thread = threading.Thread(target=teardown, name="process-group-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or failed:
        why = f"failed: {failed[0]}" if failed else f"did not end within {timeout_s:.0f} s"
        print(f"warning: the process-group teardown {why}; exiting without it", file=sys.stderr)
        return False
    return True


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch and Megatron's tracked RNG states (CPU or CUDA).

    Like Megatron-LM, pipeline stages get ``seed + 100 * pp_rank`` so that stages do not
    initialize their layers identically.
    """
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    install_cpu_rng_tracker(
        seed,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
    )


def initialize_parallel(
    parallel_cfg: ParallelConfig, seed: int, *, timeout_minutes: int = 30
) -> ParallelLayout:
    """Initialize torch.distributed (if needed), Megatron's parallel_state, and the RNGs;
    returns this rank's :class:`ParallelLayout` (computed once here, passed on from here).

    Uses the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) when torch.distributed is
    not initialized yet; a plain ``python`` run becomes a world of one. Backend: nccl on GPU,
    gloo on CPU. Calling it again with the same layout only re-seeds; a different layout raises
    (call ``destroy_parallel()`` first).
    """
    _init_process_group(timeout_minutes)
    redirect_cuda_device_to_cpu()
    world = dist.get_world_size()
    if world % parallel_cfg.model_parallel_size:
        raise ValueError(
            f"world size {world} is not divisible by tensor * pipeline * context parallel sizes "
            f"= {parallel_cfg.model_parallel_size}"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(**parallel_cfg.layout_sizes())
    layout = ParallelLayout.current(parallel_cfg.sequence_parallel)
    current, wanted = layout.sizes, ParallelLayout.of_config(parallel_cfg).sizes
    if current != wanted:
        raise RuntimeError(
            f"Megatron parallel_state is already initialized with (TP, PP, CP, EP) = {current}"
            f", not {wanted}; call destroy_parallel() first"
        )
    seed_everything(seed)
    return layout


def parallel_initialized() -> bool:
    """Whether Megatron's parallel state is initialized (``initialize_parallel`` ran)."""
    return parallel_state.model_parallel_is_initialized()


def current_layout() -> ParallelLayout | None:
    """This rank's layout where Megatron's parallel state is initialized, else None (a plain
    process: the reward scorer then scores on every rank). For the places that are handed no
    layout (a rollout source's reward scorer, built by a plug-in's factory)."""
    if not (dist.is_initialized() and parallel_initialized()):
        return None
    return ParallelLayout.current(sequence_parallel=False)  # roles and groups: SP plays no part


def destroy_parallel() -> None:
    """Tear down Megatron's parallel_state (torch.distributed itself stays initialized)."""
    parallel_state.destroy_model_parallel()
    reset_rng_tracker()
