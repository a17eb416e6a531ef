"""Context-parallel causal attention over packed documents, by all-gathering keys and values.

Megatron's THD context parallelism (``batch.split_for_context_parallel``, Transformer Engine's
layout) pads each document to a multiple of ``2 * CP`` tokens, cuts it into ``2 * CP`` chunks of
``c`` tokens and gives CP rank ``r`` chunks ``r`` and ``2 * CP - 1 - r`` (load balance under the
causal mask). RoPE is applied to the local tokens before attention, with their global positions.

Here every rank all-gathers K and V over the CP group (backward: reduce-scatter of their
gradients), rebuilds each document's keys in global order, and runs its two query chunks with
one SDPA call each: chunk ``i`` (global positions ``i * c .. (i + 1) * c - 1``) attends to the key
prefix of length ``(i + 1) * c`` under a lower-right-aligned causal mask. Documents of equal
padded length are batched. This is the all-gather scheme (as in Llama 3's context parallelism):
communication is one all-gather of K and V per layer, and each rank holds the full-length K and V
of its documents for backward, which is small under GQA next to the rest of the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch.nn.attention.bias import causal_lower_right

from megatron_grpo.ops.comm import TPInfo, all_gather_rows, reduce_scatter_rows


class _GatherRows(torch.autograd.Function):
    """[T_local, ...] -> [C * T_local, ...] rank-major; backward sums the gradients' shares."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, info: TPInfo) -> torch.Tensor:
        ctx.info = info
        return all_gather_rows(x, info)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_rows(grad, ctx.info), None


@dataclass
class _LengthGroup:
    """The documents of one padded length ``2 * C * chunk`` on this rank."""

    chunk: int
    key_index: torch.Tensor  # [B, 2 C chunk]: positions in the gathered keys, global order
    query_index: tuple[torch.Tensor, torch.Tensor]  # [B, chunk] local rows of chunks r, 2C-1-r
    prefix: tuple[int, int]  # key prefix lengths of those two chunks


def _layout(params: PackedSeqParams, info: TPInfo, t_local: int, device) -> list[_LengthGroup]:
    cu = params.cu_seqlens_q_padded
    cu = params.cu_seqlens_q if cu is None else cu
    cached = getattr(params, "_grpo_cp_layout", None)
    if cached is not None and cached[0] is cu and cached[1:3] == (cu._version, device):
        return cached[3]
    c2, r = 2 * info.size, info.rank
    bounds = cu.tolist()
    if bounds[-1] != t_local * info.size:
        raise ValueError(
            f"context parallelism: the padded documents hold {bounds[-1]} tokens, but the "
            f"{info.size} ranks hold {t_local} each (split_for_context_parallel's layout?)"
        )
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if (end - start) % c2:
            raise ValueError(
                f"context parallelism: a document of {end - start} padded tokens is not a "
                f"multiple of 2 * context_parallel_size = {c2}"
            )
        if end > start:
            by_length.setdefault(end - start, []).append(start // info.size)
    groups = []
    for length, offsets in by_length.items():
        c = length // c2
        o = torch.tensor(offsets)[:, None]  # local start of each document
        t = torch.arange(c)
        # global chunk i lives on rank i (first half) or 2C-1-i (second half of the local slice)
        keys = [
            (i if i < info.size else c2 - 1 - i) * t_local + o + (0 if i < info.size else c) + t
            for i in range(c2)
        ]
        groups.append(
            _LengthGroup(
                chunk=c,
                key_index=torch.cat(keys, dim=1).to(device),
                query_index=((o + t).to(device), (o + c + t).to(device)),
                prefix=((r + 1) * c, (c2 - r) * c),
            )
        )
    params._grpo_cp_layout = (cu, cu._version, device, groups)
    return groups


def cp_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    group: dist.ProcessGroup,
    *,
    scale: float,
    dropout_p: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """This CP rank's attention output ``[T_local, n_q, d]`` for its ``q [T_local, n_q, d]``,
    ``k, v [T_local, n_kv, d]`` (``enable_gqa=False``: the caller has repeated k / v heads)."""
    info = TPInfo.of(group)
    groups = _layout(params, info, q.size(0), q.device)
    kg, vg = (_GatherRows.apply(x, info) for x in (k, v))  # [C * T_local, n_kv, d]
    extra = {"enable_gqa": True} if enable_gqa else {}
    out = q.new_zeros(q.shape)
    for g in groups:
        kb, vb = (x[g.key_index].transpose(1, 2) for x in (kg, vg))  # [B, n_kv, L, d]
        for rows, prefix in zip(g.query_index, g.prefix, strict=True):
            qb = q[rows].transpose(1, 2)  # [B, n_q, chunk, d]
            ob = F.scaled_dot_product_attention(
                qb,
                kb[:, :, :prefix],
                vb[:, :, :prefix],
                attn_mask=causal_lower_right(g.chunk, prefix),
                dropout_p=dropout_p,
                scale=scale,
                **extra,
            )
            out = out.index_put((rows.reshape(-1),), ob.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out
