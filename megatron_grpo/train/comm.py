"""The trainer's small collectives over float scalars and flags.

Data is sharded over data-parallel ranks only: the TP, CP and PP ranks of one model replica see
the same samples (CP splits each sequence inside the step). Which rank owns which data, and who
logs, are facts of the :class:`~megatron_grpo.megatron.layout.ParallelLayout`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_grpo.megatron.parallel import all_reduce_max, all_reduce_sum, comm_device

__all__ = [
    "all_reduce_max",  # megatron/parallel.py's, as all_reduce_sum
    "all_reduce_sum",  # megatron/parallel.py's (the routing-replay metrics use it too)
    "any_rank",
]


def any_rank(flags: list[bool]) -> list[bool]:
    """Element-wise OR of ``flags`` over the whole world."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]
