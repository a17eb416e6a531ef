"""The fused decode step's TP all-reduce: NCCL, or one-shot over symmetric memory.

A decode step of a TP engine all-reduces two row-parallel outputs a layer (``[b, H]``: at TP 4
with 256 rows and H = 4096, 2 MiB each; 72 a step for a 36-layer model). NCCL's ring pays its
launch and protocol latency on each. The one-shot path (torch's ``symm_mem`` ops, the technique
of vLLM's custom all-reduce) copies the rank's partial sum into a buffer every TP rank mapped at
start-up, and one kernel reads all TP ranks' buffers over NVLink and sums them: one launch, no
ring steps, no multicast (NVLS stays off: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``). It moves
``TP x`` the bytes NCCL's ring moves, so it wins on small messages only: messages above
:func:`one_shot_max_bytes` keep NCCL (a decode step's message shrinks with its batch, so the
long tail of a rollout takes one-shot and full batches NCCL).

The decision (``rollout.engine.tp_all_reduce``): "nccl", "one_shot" (needs CUDA, TP > 1 and the
TP group's GPUs in one NVLink domain; anything else is an error naming the field), or "auto":
one-shot where it runs at a TP size :data:`MEASURED_AHEAD_UP_TO` lists (measured ahead by
``tools/bench_tp_all_reduce.py``), else NCCL.

Both paths give every rank the same sum; at TP 2 a + b is one rounding either way, so the one-shot
result equals NCCL's bit for bit (the GPU test checks it, inside a CUDA graph too).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.ops.kernels import CHOICES, check_choice

TP_ALL_REDUCE = CHOICES["tp_all_reduce"]
FIELD = "rollout.engine.tp_all_reduce"
# "auto": one-shot at these TP sizes for messages up to these bytes, where it was measured ahead
# of NCCL inside CUDA graphs (tools/bench_tp_all_reduce.py, 4 x H200 of one host, 2026-11-28:
# TP 4 0.78-0.95x up to 512 KiB, 1.04-1.32x from 1 MiB; TP 2 within 5% either way: NCCL)
MEASURED_AHEAD_UP_TO: dict[int, int] = {4: 512 << 10}
# an explicit "one_shot" at a TP size the table lacks: up to this many bytes
ONE_SHOT_MAX_BYTES = 512 << 10


def one_shot_max_bytes(tp_size: int) -> int:
    """The largest message (bytes) one-shot takes at ``tp_size``; larger ones keep NCCL."""
    return MEASURED_AHEAD_UP_TO.get(tp_size, ONE_SHOT_MAX_BYTES)


def one_shot_unavailable(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """Why the one-shot path cannot run for ``group`` on ``device`` ("" when it can).
    Symmetric memory maps the peers' GPU memory, so the group must lie on one host: its global
    ranks must share ``rank // LOCAL_WORLD_SIZE`` (torchrun's; default: this host's GPUs)."""
    if group is None or dist.get_world_size(group) == 1:
        return "TP is 1 (nothing to reduce)"
    if device.type != "cuda":
        return f"the model is on {device.type} (one-shot needs CUDA symmetric memory)"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    hosts = {r // local for r in dist.get_process_group_ranks(group)}
    if len(hosts) > 1:
        return f"the TP group spans {len(hosts)} hosts of {local} ranks each"
    return ""


def reduce_path(
    choice: str, group: dist.ProcessGroup | None, device: torch.device, decode_path: str = "fused"
) -> str:
    """The one decision: "nccl" or "one_shot" (``choice``: ``rollout.engine.tp_all_reduce``).
    Only the fused decode step reduces here (``decode_path``: the decode plan's; megatron-core's
    modules all-reduce by themselves)."""
    check_choice("tp_all_reduce", choice, FIELD)
    if decode_path != "fused" and choice == "one_shot":
        why = "this engine decodes through the modules"
        raise ValueError(f"{FIELD} 'one_shot' needs the fused decode path ({why})")
    if choice == "nccl" or decode_path != "fused" or group is None:
        return "nccl"
    if dist.get_world_size(group) == 1:
        return "nccl"
    why = one_shot_unavailable(group, device)
    if choice == "one_shot":
        if why:
            raise ValueError(f"{FIELD} 'one_shot' cannot run here: {why} (use 'nccl' or 'auto')")
        return "one_shot"
    ahead = dist.get_world_size(group) in MEASURED_AHEAD_UP_TO
    return "one_shot" if ahead and not why else "nccl"


class TPAllReduce:
    """``reduce(t)`` -> the sum of ``t [b, H]`` over the TP group, the same on every rank (NCCL
    sums ``t`` in place; one-shot returns a new tensor). ``path``: :func:`reduce_path`'s.

    "one_shot" maps one ``max_bytes`` buffer once (a collective of the TP group: every rank
    builds its reducer in the same call); messages that do not fit take NCCL. The buffer stays
    mapped for the reducer's life, so CUDA graphs captured around it stay valid.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        path: str,
        device: torch.device,
        max_bytes: int | None = None,
    ) -> None:
        """``max_bytes``: one-shot's largest message (None: :func:`one_shot_max_bytes`)."""
        check_choice("tp_all_reduce", path, FIELD)
        if path == "auto":
            raise ValueError("TPAllReduce takes a resolved path: reduce_path(...)'s")
        tp = 1 if group is None else dist.get_world_size(group)
        self.group, self.path = group, path
        self.max_bytes = one_shot_max_bytes(tp) if max_bytes is None else max_bytes
        self.buffer: Tensor | None = None
        if path == "one_shot":
            from torch.distributed import _symmetric_memory as symm_mem

            self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(self.buffer, group.group_name)

    def __call__(self, t: Tensor) -> Tensor:
        if self.group is None:
            return t
        nbytes = t.numel() * t.element_size()
        if self.buffer is None or nbytes > self.max_bytes or not t.is_contiguous():
            dist.all_reduce(t, group=self.group)
            return t
        symm = self.buffer[:nbytes].view(t.dtype).view(t.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(symm, t, "sum", self.group.group_name)
