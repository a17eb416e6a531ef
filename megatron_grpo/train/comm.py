"""The trainer's parallel plumbing: which data a rank owns, who logs, small collectives.

Data is sharded over data-parallel ranks only: the TP, CP and PP ranks of one model replica see
the same samples (CP splits each sequence inside ``megatron.forward``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_grpo.megatron.parallel import all_reduce_sum, comm_device

__all__ = [
    "all_reduce_max",
    "all_reduce_sum",  # megatron/parallel.py's (the routing-replay metrics use it too)
    "any_rank",
    "dp_cp_group",
    "dp_rank_size",
    "is_last_stage",
    "is_logging_rank",
]


def dp_rank_size() -> tuple[int, int]:
    return (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )


def dp_cp_group() -> dist.ProcessGroup:
    """The replicas that hold different tokens of one step (loss metrics are reduced over it)."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def is_last_stage() -> bool:
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def is_logging_rank() -> bool:
    """One rank that holds the loss metrics: last pipeline stage, first TP / DP / CP rank."""
    return (
        is_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )


def all_reduce_max(values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Element-wise max of float64 scalars over ``group`` (None = the whole world)."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def any_rank(flags: list[bool]) -> list[bool]:
    """Element-wise OR of ``flags`` over the whole world."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]
