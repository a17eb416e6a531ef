"""The fused decode step's TP all-reduce: NCCL, or one-shot / two-shot over symmetric memory.

A decode step of a TP engine all-reduces two row-parallel outputs a layer (``[b, H]``: at TP 4
with 256 rows and H = 4096, 2 MiB each; 72 a step for a 36-layer model). Inside a CUDA graph
NCCL picks its low-latency protocol for these sizes, which moves data at a fraction of NVLink's
bandwidth (an 8B TP4 decode step at 256 rows: 34 us an all-reduce, a third of the step's kernel
time). Over symmetric memory (torch's ``symm_mem`` ops, the technique of vLLM's custom
all-reduce) every TP rank maps one buffer of each peer once at start-up; the rank's partial sum
is copied into its buffer and

* "one_shot": one kernel reads all TP ranks' buffers over NVLink and sums them (one launch,
  ``TP x`` the bytes of NCCL's ring: small messages);
* "two_shot": each rank sums its 1/TP of the message from all buffers, then gathers the other
  ranks' sums (a reduce-scatter and an all-gather in one kernel: larger messages).

No multicast either way (NVLS stays off: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).

The decision (``rollout.engine.tp_all_reduce``), made once by :func:`reduce_tiers` as data: a
tuple of ``(largest message bytes, kernel)`` tiers, smallest first; a message takes the first
tier it fits (a tier may name NCCL), NCCL above the last (and where none). "nccl": no tiers;
"one_shot" / "two_shot": that kernel up to :data:`SYMM_MAX_BYTES` (needs CUDA, TP > 1 and the
TP group on one host; anything else is an error naming the field); "auto": the tiers
:data:`MEASURED_AHEAD` lists for the TP size (measured ahead of NCCL by
``tools/bench_tp_all_reduce.py``), else NCCL.

Every path gives every rank the same sum; at TP 2 a + b is one rounding either way, so the
symmetric-memory result equals NCCL's bit for bit (the GPU test checks it, inside a CUDA graph).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.ops.kernels import check_choice

FIELD = "rollout.engine.tp_all_reduce"
Tiers = tuple[tuple[int, str], ...]  # (largest message bytes, "nccl" | "one_shot" | "two_shot")
KERNELS = ("one_shot", "two_shot")  # over symmetric memory; a tier may also name "nccl"
# an explicit choice: its kernel up to this many bytes, NCCL above
SYMM_MAX_BYTES = {"one_shot": 512 << 10, "two_shot": 8 << 20}
# "auto": per TP size, the tiers measured ahead of NCCL inside CUDA graphs
# (tools/bench_tp_all_reduce.py, 4 x H200 of one host, 2026-11-28, [rows, 4096] bf16): TP 4
# one-shot 0.79-0.95x of NCCL up to 512 KiB, two-shot 0.86-0.97x from 1 MiB; TP 2 one-shot
# within 5% of NCCL up to 1 MiB (NCCL kept), two-shot 0.75-0.86x at 2-4 MiB
MEASURED_AHEAD: dict[int, Tiers] = {
    2: ((1 << 20, "nccl"), (8 << 20, "two_shot")),
    4: ((512 << 10, "one_shot"), (8 << 20, "two_shot")),
}


def symm_mem_unavailable(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """Why symmetric memory cannot reduce over ``group`` on ``device`` ("" when it can).
    It maps the peers' GPU memory, so the group must lie on one host: its global ranks must
    share ``rank // LOCAL_WORLD_SIZE`` (torchrun's; default: this host's GPUs)."""
    if group is None or dist.get_world_size(group) == 1:
        return "TP is 1 (nothing to reduce)"
    if device.type != "cuda":
        return f"the model is on {device.type} (symmetric memory needs CUDA)"
    if not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no symm_mem all-reduce ops"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    hosts = {r // local for r in dist.get_process_group_ranks(group)}
    if len(hosts) > 1:
        return f"the TP group spans {len(hosts)} hosts of {local} ranks each"
    return ""


def reduce_tiers(
    choice: str, group: dist.ProcessGroup | None, device: torch.device, decode_path: str = "fused"
) -> Tiers:
    """The one decision (``choice``: ``rollout.engine.tp_all_reduce``): the symmetric-memory
    tiers, ``()`` for NCCL alone. Only the fused decode step reduces here (``decode_path``: the
    decode plan's; megatron-core's modules all-reduce by themselves)."""
    check_choice("tp_all_reduce", choice, FIELD)
    explicit = choice in KERNELS
    if decode_path != "fused" and explicit:
        why = "this engine decodes through the modules"
        raise ValueError(f"{FIELD} {choice!r} needs the fused decode path ({why})")
    if choice == "nccl" or decode_path != "fused":
        return ()
    why = symm_mem_unavailable(group, device)  # TP 1 (no group) too: an explicit kernel errs
    if explicit:
        if why:
            raise ValueError(f"{FIELD} {choice!r} cannot run here: {why} (use 'nccl' or 'auto')")
        return ((SYMM_MAX_BYTES[choice], choice),)
    return () if why else MEASURED_AHEAD.get(dist.get_world_size(group), ())


def describe(tiers: Tiers) -> str:
    """``"one_shot <= 512 KiB, then NCCL"`` (the engine's start-up line)."""
    parts = [f"{kernel} <= {nbytes >> 10} KiB" for nbytes, kernel in tiers]
    return ", ".join([*parts, "then NCCL"]) if parts else "NCCL"


class TPAllReduce:
    """``reduce(t)`` -> the sum of ``t [b, H]`` over the TP group, the same on every rank, in
    place in ``t`` (one-shot: a new tensor). ``tiers``: :func:`reduce_tiers`'s.

    With tiers it maps one buffer of the largest tier's size once (a collective of the TP
    group: every rank builds its reducer in the same call). The buffer stays mapped for the
    reducer's life, so CUDA graphs captured around it stay valid.
    """

    def __init__(self, group: dist.ProcessGroup | None, tiers: Tiers, device: torch.device):
        for nbytes, kernel in tiers:
            if kernel not in ("nccl", *KERNELS) or nbytes <= 0:
                names = " | ".join(("nccl", *KERNELS))
                raise ValueError(f"a tier is (bytes > 0, {names}), got {(nbytes, kernel)}")
        self.group, self.tiers = group, tiers
        self.buffer: Tensor | None = None
        symm = [nbytes for nbytes, kernel in tiers if kernel in KERNELS]
        if symm:
            from torch.distributed import _symmetric_memory as symm_mem

            size = max(symm)
            self.buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(self.buffer, group.group_name)
            # two-shot splits the message into TP 16-byte-aligned parts
            self._two_shot_align = 16 * dist.get_world_size(group)

    def kernel(self, t: Tensor) -> str:
        """Which kernel sums ``t``: the first tier it fits, else "nccl"."""
        nbytes = t.numel() * t.element_size()
        if self.buffer is None or not t.is_contiguous():
            return "nccl"
        for limit, kernel in self.tiers:
            if nbytes <= limit:
                if kernel == "two_shot" and nbytes % self._two_shot_align:
                    return "nccl"
                return kernel
        return "nccl"

    def __call__(self, t: Tensor) -> Tensor:
        if self.group is None:
            return t
        kernel = self.kernel(t)
        if kernel == "nccl":
            dist.all_reduce(t, group=self.group)
            return t
        name = self.group.group_name
        symm = self.buffer[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        if kernel == "one_shot":
            return torch.ops.symm_mem.one_shot_all_reduce_copy(symm, t, "sum", name)
        symm.copy_(t)
        return torch.ops.symm_mem.two_shot_all_reduce_out(symm, "sum", name, t)
