"""Stacked expert weights <-> megatron-core's per-expert checkpoint tensors.

megatron-core's ``SequentialMLP`` checkpoints expert ``e`` of a layer's linear_fc<n> as one
shard of the global tensor ``<prefix>experts.linear_fc<n>.weight`` ``[E, rows, cols]`` (an
expert axis after the layer axis, then the expert-TP axis), or, with the ``singleton_local_shards``
metadata, as its own tensor ``<prefix>experts.<e>.linear_fc<n>.weight``. A gated fc1 is saved
as its two halves (gate rows, then up rows; each TP-sharded on its own, megatron-core's swiglu
factory), so the TP size can change between save and load.

:func:`stacked_expert_factory` gives a stacked ``[E_local, rows, cols]`` weight (or an optimizer
state of that shape) exactly those tensors on save, and stacks the loaded ones back: a checkpoint
moves between ``SequentialMLP`` and ``GroupedExperts`` in either direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)


@dataclass(frozen=True)
class ExpertShards:
    """Where this rank's local experts sit: EP rank/size, expert-TP rank/size, expert-DP rank."""

    num_local: int
    ep_rank: int
    ep_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    singleton: bool  # metadata["singleton_local_shards"]: one checkpoint tensor per expert

    def global_index(self, local: int) -> int:
        return self.ep_rank * self.num_local + local


def _expert_key_offsets(key: str, local: int, shards: ExpertShards, offsets: tuple):
    """(checkpoint key, sharded offsets) of local expert ``local``: one tensor per expert with
    ``singleton`` ("<..>experts.<e>.<tail>"), else a shard along an expert axis."""
    e = shards.global_index(local)
    if shards.singleton:
        head, _, tail = key.rpartition("experts.")
        return f"{head}experts.{e}.{tail}", tuple(offsets)
    return key, (*offsets, (len(offsets), e, shards.ep_size * shards.num_local))


def expert_extra_states(prefix: str, shards: ExpertShards, offsets: tuple) -> dict:
    """SequentialMLP's per-expert ``linear_fc<n>._extra_state`` objects (None: megatron-core's
    local linear layers keep no extra state), so a checkpoint written from grouped experts has
    every entry SequentialMLP loads. Dict keys ``<prefix>local_experts.<e>.linear_fc<n>...``."""
    out = {}
    for local in range(shards.num_local):  # checkpoint layout only, not the compute
        for n in (1, 2):
            key, exp_offsets = _expert_key_offsets(
                f"{prefix}experts.linear_fc{n}._extra_state", local, shards, offsets
            )
            axes = sorted(exp_offsets)  # megatron-core's ShardedObject offsets: by axis
            out[f"{prefix}local_experts.{local}.linear_fc{n}._extra_state"] = ShardedObject(
                key,
                None,
                tuple(a[2] for a in axes) or (1,),
                tuple(a[1] for a in axes) or (0,),
                (0, shards.tp_rank, shards.dp_rank),
            )
    return out


def _expert_tensors(
    key: str,
    weight: torch.Tensor,
    local: int,
    shards: ExpertShards,
    offsets: tuple,
    tp_axis: int,
    glu: bool,
) -> list[ShardedTensor]:
    """The checkpoint tensors of local expert ``local`` (1, or 2 for a GLU fc1)."""
    key, expert_offsets = _expert_key_offsets(key, local, shards, offsets)
    axis = tp_axis + len(expert_offsets)
    replica = (0, 0, shards.dp_rank)  # SequentialMLP: replicated along expert-DP only
    parts = weight[local].chunk(2, dim=0) if glu else (weight[local],)
    if glu:  # megatron-core's swiglu split: halves at rank and TP + rank of 2 TP fragments
        tp, r = shards.tp_size, shards.tp_rank
        suffix = ("_w", "_v") if shards.singleton else ("", "")
        tp_offsets = (
            ((axis, r, tp), (axis, r, tp))
            if shards.singleton
            else ((axis, r, 2 * tp), (axis, tp + r, 2 * tp))
        )
    else:
        suffix, tp_offsets = ("",), ((axis, shards.tp_rank, shards.tp_size),)
    return [
        ShardedTensor.from_rank_offsets(
            key + s,
            part,
            *expert_offsets,
            tp_off,
            replica_id=replica,
            prepend_axis_num=len(expert_offsets),
        )
        for part, s, tp_off in zip(parts, suffix, tp_offsets, strict=True)
    ]


def stacked_expert_factory(
    key: str, weight: torch.Tensor, shards: ExpertShards, offsets: tuple, *, tp_axis: int, glu: bool
) -> ShardedTensorFactory:
    """A factory that saves ``weight [E_local, rows, cols]`` as SequentialMLP's per-expert
    tensors under ``key`` (``<prefix>experts.linear_fc<n>.weight``) and loads them stacked.

    ``offsets``: the sharded offsets of the enclosing layer (the layer axis); ``tp_axis``: 0
    for linear_fc1 (rows), 1 for linear_fc2 (columns); ``glu``: fc1 holds gate and up halves.
    """

    def build(key: str, data: torch.Tensor, replica_id, flattened_range) -> list[ShardedTensor]:
        if flattened_range is not None:
            raise NotImplementedError(
                "grouped MoE experts: flattened (fully sharded) optimizer checkpoints are not "
                "supported; the trainer saves the distributed optimizer as dp_reshardable"
            )
        return [
            t
            for local in range(shards.num_local)  # checkpoint layout only, not the compute
            for t in _expert_tensors(key, data, local, shards, offsets, tp_axis, glu)
        ]

    def merge(loaded: list[torch.Tensor]) -> torch.Tensor:
        per_expert = len(loaded) // shards.num_local
        with torch.no_grad():
            return torch.stack(
                [torch.cat(loaded[i : i + per_expert]) for i in range(0, len(loaded), per_expert)]
            )

    return ShardedTensorFactory(key, weight, build, merge, replica_id=(0, 0, shards.dp_rank))
