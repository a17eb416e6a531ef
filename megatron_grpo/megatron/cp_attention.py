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
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch.nn.attention.bias import causal_lower_right

from megatron_grpo.megatron.packed_attention import SDPA, cached_layout


@dataclass
class _LengthGroup:
    """The documents of one padded length ``2 * C * chunk`` on this rank."""

    chunk: int
    key_index: torch.Tensor  # [B, 2 C chunk]: positions in the gathered keys, global order
    query_index: tuple[torch.Tensor, torch.Tensor]  # [B, chunk] local rows of chunks r, 2C-1-r
    prefix: tuple[int, int]  # key prefix lengths of those two chunks


def _layout(bounds: list[int], size: int, rank: int, t_local: int, device) -> list[_LengthGroup]:
    c2 = 2 * size
    if bounds[-1] != t_local * size:
        raise ValueError(
            f"context parallelism: the padded documents hold {bounds[-1]} tokens, but the "
            f"{size} ranks hold {t_local} each (split_for_context_parallel's layout?)"
        )
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if (end - start) % c2:
            raise ValueError(
                f"context parallelism: a document of {end - start} padded tokens is not a "
                f"multiple of 2 * context_parallel_size = {c2}"
            )
        if end > start:
            by_length.setdefault(end - start, []).append(start // size)
    groups = []
    for length, offsets in by_length.items():
        c = length // c2
        o = torch.tensor(offsets)[:, None]  # local start of each document
        t = torch.arange(c)
        # global chunk i lives on rank i (first half) or 2C-1-i (second half of the local slice)
        keys = [
            (i if i < size else c2 - 1 - i) * t_local + o + (0 if i < size else c) + t
            for i in range(c2)
        ]
        groups.append(
            _LengthGroup(
                chunk=c,
                key_index=torch.cat(keys, dim=1).to(device),
                query_index=((o + t).to(device), (o + c + t).to(device)),
                prefix=((rank + 1) * c, (c2 - rank) * c),
            )
        )
    return groups


def cp_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    group: dist.ProcessGroup,
    *,
    sdpa: SDPA,
) -> torch.Tensor:
    """This CP rank's attention output ``[T_local, n_q, d]`` for its ``q [T_local, n_q, d]``,
    ``k, v [T_local, n_kv, d]``. ``sdpa(q, k, v, mask)`` is the caller's SDPA on
    ``[B, n, S, d]`` batches (GQA, dropout and softmax scale included)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    groups = cached_layout(
        params, "_grpo_cp_layout", q.device,
        lambda b: _layout(b, size, rank, q.size(0), q.device),
    )  # fmt: skip
    # [C * T_local, n_kv, d], rank-major; backward reduce-scatters the gradients
    kg, vg = (gather_from_sequence_parallel_region(x, True, group) for x in (k, v))
    out = q.new_zeros(q.shape)
    for g in groups:
        kb, vb = (x[g.key_index].transpose(1, 2) for x in (kg, vg))  # [B, n_kv, L, d]
        for rows, prefix in zip(g.query_index, g.prefix, strict=True):
            qb = q[rows].transpose(1, 2)  # [B, n_q, chunk, d]
            mask = causal_lower_right(g.chunk, prefix)
            ob = sdpa(qb, kb[:, :, :prefix], vb[:, :, :prefix], mask)
            out = out.index_put((rows.reshape(-1),), ob.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out
