"""Packed batches to and from the model: the CP split and SP checks going in, the forward
itself (hidden states on the last stage), and per-token results gathered over CP and
broadcast over PP coming back. The padding multiples are the layout's
(:class:`~megatron_grpo.megatron.layout.ParallelLayout`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.attention.packed import remember_host_bounds
from megatron_grpo.megatron.batch.packing import (
    PackedBatch,
    packed_seq_params,
    padded_layout,
    split_for_context_parallel,
    thd_partition_index,
)
from megatron_grpo.megatron.gpt import hidden_states_only, output_weight, unwrap
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.parallel import comm_device


def prepare_batch(
    batch: PackedBatch, layout: ParallelLayout
) -> tuple[PackedBatch, PackedSeqParams]:
    """Validate, split for context parallelism (when CP > 1) and check SP divisibility:
    ``[T]`` -> this CP rank's ``[T_local]`` batch and its packed-sequence params."""
    batch.validate()
    multiple = layout.token_multiple
    if layout.cp_size > 1:
        local, params, _ = split_for_context_parallel(
            batch, layout.cp_size, layout.cp_rank, multiple
        )
        return local, params
    if batch.num_tokens % multiple:
        raise ValueError(
            f"packed micro-batch length T={batch.num_tokens} must be divisible by "
            f"tensor_model_parallel_size={layout.tp_size} under sequence_parallel "
            "(pack_sequences(..., pad_to_multiple_of=TP))"
        )
    return batch, packed_seq_params(batch)


def run_model(model: torch.nn.Module, batch: PackedBatch, params: PackedSeqParams) -> Tensor:
    """Forward one (local) packed batch. Last stage: hidden ``[T_local, H]`` in the output
    weight's dtype; other stages: the activation tensor for the next stage.

    Megatron's ``Float16Module`` upcasts last-stage outputs to fp32 (bf16/fp16 runs); the
    hidden states are cast back (exact) so the log-prob paths see the GEMM dtype.
    """
    gpt = unwrap(model)
    device = next(gpt.parameters()).device
    tokens = host_to_device(batch.tokens, device)[None]
    positions = host_to_device(batch.position_ids, device)[None]
    return forward_tokens(model, tokens, positions, _params_to(params, device))


def forward_tokens(
    model: torch.nn.Module, tokens: Tensor, positions: Tensor, params: PackedSeqParams
) -> Tensor:
    """:func:`run_model` on device inputs: ``tokens``, ``positions`` ``[1, T]`` and their
    packed-sequence ``params``."""
    gpt = unwrap(model)
    if not gpt.post_process:
        return model(tokens, positions, None, packed_seq_params=params)
    with hidden_states_only(gpt):
        hidden = model(tokens, positions, None, packed_seq_params=params)
    return hidden.squeeze(1).to(output_weight(gpt).dtype)


def _params_to(params: PackedSeqParams, device: torch.device) -> PackedSeqParams:
    moved = {
        k: (host_to_device(v, device) if isinstance(v, Tensor) else v)
        for k, v in vars(params).items()
    }
    out = PackedSeqParams(**moved)
    # the attention layouts read the bounds from the host copies: no device-to-host sync
    host = {
        k: v for k, v in vars(params).items() if isinstance(v, Tensor) and v.device.type == "cpu"
    }
    remember_host_bounds(out, host)
    return out


def full_logprobs(local: Tensor | None, batch: PackedBatch, layout: ParallelLayout) -> Tensor:
    """A last-stage ``[T_local]`` (None on other stages) gathered over CP and broadcast over
    PP -> ``[T]`` on CPU, on every rank."""
    if local is not None and layout.cp_size > 1:
        local = gather_from_context_parallel(
            local, batch, layout.cp_size, layout.token_multiple, layout.cp_group
        )
    if layout.pp_size > 1:
        buf = local if local is not None else torch.empty(batch.num_tokens, device=comm_device())
        group = layout.pp_group
        src = dist.get_global_rank(group, dist.get_world_size(group) - 1)
        dist.broadcast(buf.float().contiguous() if local is not None else buf, src=src, group=group)
        local = buf
    return local.float().cpu()


def gather_from_context_parallel(
    local: Tensor, batch: PackedBatch, cp_size: int, multiple: int, group: dist.ProcessGroup
) -> Tensor:
    """Inverse of :func:`split_for_context_parallel` for a per-token ``[T_local]`` tensor."""
    shards = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    cu_pad, dest = padded_layout(batch, cp_size, multiple)
    full = local.new_zeros(int(cu_pad[-1]))
    for rank, shard in enumerate(shards):
        full[thd_partition_index(cu_pad, cp_size, rank).to(local.device)] = shard
    return full[dest.to(local.device)]
