"""The Megatron side: the converter's view of the GPTModel and its torch_dist checkpoint.

The checkpoint layout is never written down here: it is whatever ``sharded_state_dict()`` of
the GPTModel from ``megatron_grpo.megatron.model.build.build_gpt_chunk`` says. The converter builds
that model on the meta device at TP=PP=EP=1 (no parameter memory), asks it for its sharded
state dict (global keys, shapes, layer/expert offsets, swiglu split) and fills in the data:
memory-mapped tensors, so ``dist_checkpointing.save`` streams them to disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.megatron.compat import writer_memory_logging_without_psutil
from megatron_grpo.megatron.config import ModelConfig, ParallelConfig, to_transformer_config
from megatron_grpo.megatron.model.build import build_gpt_chunk
from megatron_grpo.megatron.parallel import (
    cuda_compat,
    destroy_parallel,
    initialize_parallel,
    parallel_initialized,
)

# dict key (model parameter name) -> its checkpoint shards (2 for a swiglu-split linear_fc1)
Entries = dict[str, list[ShardedTensor]]


_HAS_DTYPE = "dtype" in {f.name for f in dataclasses.fields(ShardedTensor)}


def set_data(sharded: ShardedTensor, data: torch.Tensor) -> None:
    """Point ``sharded`` at ``data`` (its dtype attribute, where present, must follow)."""
    sharded.data = data
    if _HAS_DTYPE:
        sharded.dtype = data.dtype


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """A world of one (in-process store, no port) with Megatron's parallel_state at TP=PP=EP=1.

    Reuses an existing world of one; whatever this context created is torn down on exit.
    """
    created_pg = not dist.is_initialized()
    if created_pg:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise ConversionError("checkpoint conversion runs in one process, not under torchrun")
    created_ps = not parallel_initialized()
    try:
        initialize_parallel(ParallelConfig(), seed=0)
        yield
    finally:
        if created_ps:
            destroy_parallel()
        if created_pg:
            dist.destroy_process_group()


def cpu_moe_overrides(model_cfg: ModelConfig) -> dict[str, Any]:
    """TransformerConfig overrides for MoE on a CPU-only host: megatron-core's alltoall
    dispatcher creates CUDA streams, and its allgather dispatcher requires fixed sequence
    lengths. Neither changes parameters or checkpoint keys."""
    if model_cfg.num_moe_experts is None or torch.cuda.is_available():
        return {}
    return {"moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False}


def meta_model(model_cfg: ModelConfig) -> torch.nn.Module:
    """The GPTModel at TP=PP=EP=1 on the meta device (needs :func:`single_process_megatron`).

    Uses the portable layer spec: its checkpoint keys equal the Transformer Engine spec's. MoE
    experts as megatron-core's SequentialMLP (one state-dict entry per expert, the converter's
    rules): the grouped experts write the same checkpoint tensors (``expert_checkpoint``).
    """
    moe = model_cfg.num_moe_experts is not None
    cfg = dataclasses.replace(
        model_cfg, transformer_impl="local", moe_grouped_gemm=False if moe else None
    )
    extra = {"use_cpu_initialization": True, "perform_initialization": False}
    if cfg.num_moe_experts is not None:
        extra |= {"moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False}
    config = to_transformer_config(cfg, ParallelConfig(), params_dtype=torch.float32, extra=extra)
    with torch.device("meta"):
        return build_gpt_chunk(cfg, config, None)


def checkpoint_entries(model: torch.nn.Module) -> tuple[Entries, dict[str, Any]]:
    """``(tensor entries, other entries)`` of the model's sharded state dict, factories applied.

    Other entries are ShardedObjects (``_extra_state``) and plain values, saved as they are.
    """
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    tensors: Entries = {}
    others: dict[str, Any] = {}
    for name, value in sharded.items():
        parts = value if isinstance(value, list) else [value]
        if all(isinstance(p, ShardedTensor) for p in parts):
            tensors[name] = parts
        elif isinstance(value, ShardedObject) or not isinstance(value, list):
            others[name] = value
        else:
            raise ConversionError(f"unexpected sharded state dict entry {name}: {value!r}")
    return tensors, others


@contextlib.contextmanager
def checkpoint_io() -> Iterator[None]:
    """megatron-core's torch_dist writer: CUDA calls redirected on CPU-only hosts
    (``cuda_compat``), and, without psutil, its writer processes' memory logging stubbed out
    (``compat.writer_memory_logging_without_psutil``)."""
    with cuda_compat(), writer_memory_logging_without_psutil():
        yield


def save_checkpoint(tensors: Entries, others: dict[str, Any], ckpt_dir: Path) -> None:
    """``dist_checkpointing.save`` (torch_dist) of the filled entries into ``ckpt_dir``."""
    state: dict[str, Any] = dict(others)
    for name, parts in tensors.items():
        state[name] = parts if len(parts) > 1 else parts[0]
    with checkpoint_io():
        dist_checkpointing.save(state, str(ckpt_dir))


@dataclass(frozen=True)
class StoredTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]


def stored_tensors(ckpt_dir: Path) -> dict[str, StoredTensor]:
    """Global tensor key -> dtype and global shape, from the checkpoint's DCP metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (ckpt_dir / ".metadata").is_file():
        raise ConversionError(f"{ckpt_dir}: not a torch_dist checkpoint (no .metadata)")
    meta = FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    return {
        k: StoredTensor(v.properties.dtype, tuple(v.size))
        for k, v in meta.items()
        if isinstance(v, TensorStorageMetadata)
    }


class _SliceLoadPlanner(LoadPlanner):
    """Reads given regions of global checkpoint tensors into given tensors.

    megatron-core's loader cannot read part of a layer-stacked tensor in a world of one (its
    torch ShardedTensor shim places the "other" shards on rank 0), so the exporter reads its
    batches through torch.distributed.checkpoint directly: region ``(key, global offsets)``
    -> the saved chunks overlapping it (``create_read_items_for_chunk_list``), whatever TP/PP/EP
    layout wrote them.
    """

    def __init__(self, targets: dict[tuple[str, tuple[int, ...]], torch.Tensor]) -> None:
        self.targets = targets

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for (key, offsets), target in self.targets.items():
            chunk = ChunkStorageMetadata(torch.Size(offsets), target.shape)
            md = self.metadata.state_dict_metadata[key]
            items += create_read_items_for_chunk_list(key, md, [chunk])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise ConversionError(f"unexpected non-tensor item {read_item.dest_index.fqn}")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        index = read_item.dest_index
        target = self.targets[(index.fqn, tuple(index.offset))]
        for dim, (start, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the target: the data is already in place


def load_tensors(ckpt_dir: Path, tensors: Entries, names: list[str]) -> dict[str, list]:
    """Entries ``names`` (each as its shards, TP=1 layout, stored dtype) from a torch_dist
    checkpoint. Regions a checkpoint with a smaller padded vocabulary lacks stay zero."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    stored = stored_tensors(ckpt_dir)
    targets: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    out: dict[str, list] = {}
    for name in names:
        out[name] = []
        for part in tensors[name]:
            shape = (1,) * part.prepend_axis_num + tuple(part.local_shape)
            target = torch.zeros(shape, dtype=stored[part.key].dtype)
            targets[(part.key, tuple(part.global_offset))] = target
            out[name].append(target.view(part.local_shape))
    planner = _SliceLoadPlanner(targets)
    dcp_load({}, storage_reader=FileSystemReader(str(ckpt_dir)), planner=planner, no_dist=True)
    return out
