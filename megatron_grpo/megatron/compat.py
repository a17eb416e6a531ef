"""Every write to megatron-core's private state, in one place, with the versions it covers.

We support megatron-core 0.14 - 0.19. Each patch below names the private state it writes and
why; the version notes say where the names were checked (the installed 0.16.1, and the later
releases' sources).

Not here: ``routing_replay.py`` sets a router module's ``router_replay`` attribute to its own
hook (an instance attribute of our model, the replay's public seam in 0.16+), and the
``cuda_compat`` context of ``parallel.py`` redirects CUDA calls on CPU hosts for its duration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mcore_random


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Megatron's named RNG-state tracker over the CPU generator (for CPU-only runs).

    Writes the base class's private ``_is_initialized``, ``seeds_`` and ``states_`` exactly as
    its own ``add`` does (0.14 - 0.16 checked in 0.16.1's ``tensor_parallel/random.py``; the
    same attributes in later releases)."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_cpu_rng_tracker(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """Make :class:`CpuRNGStatesTracker` megatron-core's RNG tracker, seeded like
    ``model_parallel_cuda_manual_seed`` (data-parallel ``seed``, TP ``seed + 2718 + tp_rank``,
    expert ``seed + 1024 + 100 * ep_rank + etp_rank``).

    Writes ``tensor_parallel.random._CUDA_RNG_STATE_TRACKER`` / ``_INITIALIZED`` (module
    globals that ``get_cuda_rng_tracker`` returns / checks; 0.14 - 0.16, checked in 0.16.1,
    and the same globals in later releases, where ``initialize_rng_tracker`` gained
    ``force_reset``) and reads the private tracker names ``_*_RNG_TRACKER_NAME``."""
    tracker = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(
        mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank
    )


def reset_rng_tracker() -> None:
    """Forget megatron-core's RNG tracker (the same globals as
    :func:`install_cpu_rng_tracker`), so the next seeding creates a fresh one."""
    mcore_random._CUDA_RNG_STATE_TRACKER = None
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def set_checkpoint_results_queue(make_queue: Callable[[], Any]) -> bool:
    """Give ``dist_checkpointing``'s async file writer the results queue ``make_queue()``
    (unless it has one): False when it already had one.

    Writes ``dist_checkpointing.strategies.filesystem_async._results_queue``, the module global
    that ``_get_write_results_queue`` fills lazily with a plain Manager's queue (0.14 - 0.16,
    checked in 0.16.1; the same lazy global in later releases)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    if getattr(fsa, "_results_queue", None) is not None:
        return False
    fsa._results_queue = make_queue()
    return True


def define_te_general_gemm() -> None:
    """megatron-core 0.16's router gating (``transformer/moe/moe_utils.py``) tests
    ``te_general_gemm is not None`` but defines the name only when Transformer Engine imports,
    so without TE every MoE forward raises NameError; define it as None where it is missing
    (0.14 / 0.15 never read it, later releases define it themselves)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def use_index_chunk_sort(sort_chunks_by_index: Callable) -> bool:
    """Make megatron-core's all-to-all dispatcher order tokens by local expert with one gather
    (``sort_chunks_by_index``: ``moe/permute.py``'s, passed in so that this module imports
    nothing of the package) instead of a split + ``cat`` over every (rank, local expert) chunk;
    False when already installed.

    Writes the module attribute ``transformer.moe.token_dispatcher.sort_chunks_by_idxs`` (the
    name it imports from ``moe_utils`` and calls in ``dispatch_postprocess`` /
    ``combine_preprocess``; checked in 0.16.1 and 0.19.2). Installed by the first
    ``GroupedExperts`` built, so a process of SequentialMLP models runs megatron-core's own."""
    from megatron.core.transformer.moe import token_dispatcher

    if token_dispatcher.sort_chunks_by_idxs is sort_chunks_by_index:
        return False
    token_dispatcher.sort_chunks_by_idxs = sort_chunks_by_index
    return True


@contextlib.contextmanager
def writer_memory_logging_without_psutil() -> Iterator[None]:
    """Without psutil, megatron-core's torch_dist writer processes die importing it for their
    memory logging and the save then hangs: for the duration, the private
    ``filesystem_async._process_memory`` returns 0 (0.14 - 0.19; install psutil to avoid the
    stub). With psutil, nothing is written."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    try:
        import psutil  # noqa: F401

        stub = False
    except ImportError:
        stub = hasattr(filesystem_async, "_process_memory")
    original = getattr(filesystem_async, "_process_memory", None)
    if stub:
        filesystem_async._process_memory = lambda: 0
    try:
        yield
    finally:
        if stub:
            filesystem_async._process_memory = original
