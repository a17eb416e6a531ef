"""The policy model as generation sees it: packed prefill inputs, the LM head, group plumbing.

Both engines call the training model's own modules and weights (no second copy). Only the rows
that are sampled go through the LM head, in fp32 as in training (``mm_f32``), and only those
``[A, V_local]`` rows are all-gathered across TP. The process facts come from the engine's
:class:`~megatron_grpo.megatron.layout.ParallelLayout` (``layout``), read once per engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_grpo.megatron.attention.packed import remember_host_bounds
from megatron_grpo.megatron.gpt import hidden_states_only, output_weight
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.parallel import comm_device
from megatron_grpo.ops.lm_head.comm import TPInfo, all_gather_rows
from megatron_grpo.ops.lm_head.gemm import mm_f32
from megatron_grpo.rollout.engine.params import SamplingParams


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def packed_length(seqs: list[list[int]], pad_to: int) -> int:
    """Packed length of ``seqs``: their total, rounded up to a multiple of ``pad_to``."""
    return -(-sum(len(s) for s in seqs) // pad_to) * pad_to


def packed_inputs(
    seqs: list[list[int]], pad_to: int, num_tokens: int | None = None
) -> tuple[Tensor, Tensor, PackedSeqParams]:
    """``input_ids, position_ids`` ``[1, T]`` + THD params; T is ``num_tokens`` when given, else
    the total padded to a multiple of ``pad_to``. Padding lies after ``cu_seqlens_q[-1]``, inside
    the last document's padded bounds (``cu_seqlens_q_padded[-1] == T``)."""
    lens = [len(s) for s in seqs]
    total = sum(lens)
    padded = packed_length(seqs, pad_to)
    if num_tokens is not None:
        if num_tokens < padded or num_tokens % pad_to:
            raise ValueError(
                f"num_tokens={num_tokens} must be >= {padded} and a multiple of {pad_to}"
            )
        padded = num_tokens
    ids = torch.zeros(1, padded, dtype=torch.long)
    ids[0, :total] = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    pos = torch.zeros(1, padded, dtype=torch.long)
    pos[0, :total] = torch.cat([torch.arange(n) for n in lens])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    # The padding joins the last document in the padded bounds: megatron-core's THD RoPE splits
    # the input by them and needs them to cover every token. Causal attention keeps the real
    # tokens unaffected, and the last real positions come from the unpadded bounds.
    cu_padded = cu.clone()
    cu_padded[-1] = padded
    longest = max(max(lens), lens[-1] + padded - total)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return ids, pos, params


def packed_to(params: PackedSeqParams, device: torch.device) -> PackedSeqParams:
    host = {}
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        host[name] = getattr(params, name)
        setattr(params, name, host[name].to(device))
    remember_host_bounds(params, host)  # the attention layouts read them without a sync
    return params


def packed_last_hidden(
    model: torch.nn.Module,
    ids: Tensor,
    pos: Tensor,
    packed: PackedSeqParams,
    *,
    layout: ParallelLayout,
) -> Tensor:
    """Final-normed hidden states ``[A, H]`` at the last position of each of the A documents of
    a packed input (``packed_inputs``), from one forward; ``[T, V]`` logits are never formed."""
    device = model_device(model)
    packed = packed_to(packed, device)
    with hidden_states_only(model):
        hidden = model(ids.to(device), pos.to(device), None, packed_seq_params=packed)
    hidden = hidden.squeeze(1)  # [T_local, H]
    if model.config.sequence_parallel and layout.tp_size > 1:
        hidden = all_gather_rows(hidden, TPInfo.of(layout.tp_group))
    return hidden[packed.cu_seqlens_q[1:].long() - 1]


def head_logits(model: torch.nn.Module, hidden: Tensor, layout: ParallelLayout) -> Tensor:
    """Full-vocabulary fp32 logits ``[A, V_padded]`` of ``hidden [A, H]`` (gathered over TP)."""
    weight = output_weight(model)
    local = mm_f32(hidden.to(weight.dtype), weight.t())  # [A, V_local]
    if layout.tp_size == 1:
        return local
    return tensor_parallel.gather_from_tensor_model_parallel_region(local)


def broadcast_from_tp_src(layout: ParallelLayout, *tensors: Tensor) -> None:
    """Make every TP rank hold TP rank 0's values (no float nondeterminism can split ranks)."""
    if layout.tp_size == 1:
        return
    src, group = layout.tp_src_rank, layout.tp_group
    device = comm_device()
    for t in tensors:
        buf = t if t.device == device else t.to(device)
        dist.broadcast(buf, src, group=group)
        if buf is not t:
            t.copy_(buf)


def pads_expert_inputs(model: torch.nn.Module) -> bool:
    """The allgather dispatcher needs equal token counts over the expert group."""
    return getattr(model.config, "moe_token_dispatcher_type", None) == "allgather"


def check_layout(layout: ParallelLayout) -> None:
    if layout.pp_size > 1:
        raise ValueError(
            "generation needs pipeline_model_parallel_size == 1; generate elsewhere "
            "and train on files (rollout.input_path)"
        )
    if layout.cp_size > 1:
        raise ValueError(
            "generation needs context_parallel_size == 1; generate elsewhere and train on "
            "files (rollout.input_path)"
        )


def check_prompts(
    prompts: list[list[int]], params: SamplingParams, max_sequence_length: int
) -> None:
    """Bad prompts are errors naming the sample and the value, before any forward."""
    params.check_complete()
    if not prompts:
        raise ValueError("generate: no prompts")
    limit = max_sequence_length - params.max_new_tokens
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens > max_sequence_length ({max_sequence_length}) "
                f"- max_new_tokens ({params.max_new_tokens}) = {limit}"
            )
        bad = [t for t in p if not 0 <= int(t) < params.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} holds token id {bad[0]} outside the vocabulary "
                f"[0, {params.vocab_size})"
            )


def rope_table(model: torch.nn.Module, seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE ``(cos, sin)`` ``[seq_len, rot_dim]`` in the model dtype, from the model's own
    rotary module (YaRN included, its attention factor applied as megatron-core does); None
    without rotary embeddings."""
    kind, cfg = model.position_embedding_type, model.config
    if kind not in ("rope", "yarn"):
        if kind not in ("learned_absolute", "none"):
            raise ValueError(f"generation does not support position_embedding_type={kind!r}")
        return None
    if getattr(cfg, "multi_latent_attention", False) or getattr(cfg, "no_rope_freq", None):
        raise ValueError("generation does not support multi-latent attention or no_rope_freq")
    emb = model.rotary_pos_emb(seq_len)
    freqs = emb[0] if isinstance(emb, tuple) else emb
    mscale = 1.0
    if kind == "yarn":
        from megatron.core.transformer.attention import (
            _yarn_get_concentration_factor_from_config,
        )

        mscale = _yarn_get_concentration_factor_from_config(cfg)
    dtype = next(model.parameters()).dtype
    freqs = freqs.flatten(1)  # [seq_len, 1, 1, rot_dim] -> [seq_len, rot_dim]
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def set_sequence_parallel(model: torch.nn.Module, value: bool) -> None:
    """Switch ``model``'s sequence parallelism (off while generating: one token per row)."""
    try:
        from megatron.core.transformer.utils import set_model_to_sequence_parallel
    except ImportError as e:  # megatron-core < 0.15
        raise ValueError(
            "generation with sequence_parallel needs megatron-core's "
            "set_model_to_sequence_parallel (0.15+)"
        ) from e
    set_model_to_sequence_parallel(model, value)
