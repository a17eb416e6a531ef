"""Context-parallel causal attention over packed documents, by all-gathering keys and values.

Megatron's THD context parallelism (``batch.split_for_context_parallel``, Transformer Engine's
layout) pads each document to a multiple of ``2 * CP`` tokens, cuts it into ``2 * CP`` chunks of
``c`` tokens and gives CP rank ``r`` chunks ``r`` and ``2 * CP - 1 - r`` (load balance under the
causal mask). RoPE is applied to the local tokens before attention, with their global positions.

Here every rank all-gathers K and V over the CP group (backward: reduce-scatter of their
gradients), rebuilds each document's keys in global order, and runs its two query chunks with
one SDPA call each: chunk ``i`` (global positions ``i * c .. (i + 1) * c - 1``) attends to the key
prefix of length ``(i + 1) * c`` under a lower-right-aligned causal mask. Documents of equal
padded length are batched, and short documents of different lengths too (right-padded, under a
boolean mask; see ``_EXACT_MIN_CHUNK``), so the number of SDPA calls per layer does not grow with
the number of short documents. The layout is built once per micro-batch with tensor ops
(``cached_layout``: one device-to-host read of the bounds, reused by every layer).

This is the all-gather scheme (as in Llama 3's context parallelism): communication is one
all-gather of K and V per layer, and each rank holds the full-length K and V of its documents for
backward, which is small under GQA next to the rest of the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch.nn.attention.bias import causal_lower_right

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.attention.packed import SDPA, cached_layout

# A document whose chunk (padded length / (2 * CP)) has at least this many tokens gets a group of
# its exact length: one flash-capable SDPA call per query chunk under a lower-right causal mask,
# for every document of that length. Its attention outweighs a launch, and a micro-batch of T
# tokens holds at most T / (2 * CP * _EXACT_MIN_CHUNK) such documents. Shorter documents are
# grouped by ceil(log2(chunk)) into right-padded batches under an explicit boolean mask: at most
# log2(_EXACT_MIN_CHUNK) + 1 groups whatever the number of documents (hundreds of short rollouts
# would otherwise launch hundreds of attention calls per layer).
_EXACT_MIN_CHUNK = 256
_POW2 = 2 ** torch.arange(63)  # searchsorted(_POW2, n, right=True) = n.bit_length()


@dataclass
class _Query:
    """One query chunk (global chunk ``i``) of every document of a :class:`_LengthGroup`."""

    rows: torch.Tensor  # [B, chunk] its local rows (padding: row 0, output dropped)
    prefix: int  # it attends to key_index[:, :prefix]
    # [B, 1, chunk, prefix] bool (True = attend: key p <= i * c_b + t); None: every document has
    # chunk ``chunk`` and the mask is lower-right causal
    mask: torch.Tensor | None
    src: torch.Tensor | None  # [N] the real rows of the flattened [B * chunk] output; None: all
    dst: torch.Tensor  # [N] their local rows


@dataclass
class _LengthGroup:
    """Documents of one padded length ``2 * C * chunk`` (or of one power-of-two bucket of short
    lengths, right-padded to ``chunk``) on this rank."""

    chunk: int
    key_index: torch.Tensor  # [B, 2 C chunk]: positions in the gathered keys, global order
    queries: tuple[_Query, _Query]  # chunks r and 2C-1-r


def _layout(
    bounds: list[int],
    size: int,
    rank: int,
    t_local: int,
    device,
    exact_min_chunk: int = _EXACT_MIN_CHUNK,
) -> list[_LengthGroup]:
    """The groups of documents of the padded ``bounds`` ``[S+1]``; tensor ops, no loop over the
    S documents (only over the groups)."""
    c2 = 2 * size
    if bounds[-1] != t_local * size:
        raise ValueError(
            f"context parallelism: the padded documents hold {bounds[-1]} tokens, but the "
            f"{size} ranks hold {t_local} each (split_for_context_parallel's layout?)"
        )
    cu = torch.tensor(bounds, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    bad = lens % c2 != 0
    if bool(bad.any()):
        raise ValueError(
            f"context parallelism: a document of {int(lens[bad][0])} padded tokens is not a "
            f"multiple of 2 * context_parallel_size = {c2}"
        )
    keep = lens > 0
    chunk = (lens // c2)[keep]
    offset = (cu[:-1] // size)[keep]  # local start of each document
    bucket = torch.searchsorted(_POW2, chunk - 1, right=True)  # ceil(log2(chunk))
    key = torch.where(chunk >= exact_min_chunk, chunk, -1 - bucket)
    groups = []
    for k in torch.unique(key).tolist():
        sel = key == k
        groups.append(_group(chunk[sel], offset[sel], size, rank, t_local, device))
    return groups


def _group(
    c: torch.Tensor, o: torch.Tensor, size: int, rank: int, t_local: int, device
) -> _LengthGroup:
    """The group of the documents of chunks ``c`` ``[B]`` at local offsets ``o`` ``[B]``."""
    c2 = 2 * size
    chunk = int(c.max())
    uniform = bool((c == chunk).all())
    cb, ob = c[:, None], o[:, None]
    # key p of a document: global chunk i = p // c_b, held by rank i (first half of its local
    # slice) or 2C-1-i (second half); positions past its 2C * c_b keys read row 0 (masked)
    p = torch.arange(c2 * chunk)
    i, w = p // cb, p % cb
    low = i < size
    keys = torch.where(low, i, c2 - 1 - i) * t_local + ob + torch.where(low, 0, cb) + w
    keys = torch.where(p < c2 * cb, keys, 0)
    t = torch.arange(chunk)
    valid = t < cb  # [B, chunk]
    queries = []
    for i_q, first in ((rank, ob), (c2 - 1 - rank, ob + cb)):
        rows = torch.where(valid, first + t, 0)
        prefix = (i_q + 1) * chunk
        if uniform:
            query = _Query(
                host_to_device(rows, device),
                prefix,
                None,
                None,
                host_to_device(rows.reshape(-1), device),
            )
        else:
            mask = torch.arange(prefix) <= (i_q * cb + t)[:, :, None]  # [B, chunk, prefix]
            src = valid.reshape(-1).nonzero().squeeze(1)
            query = _Query(
                host_to_device(rows, device),
                prefix,
                host_to_device(mask[:, None], device),
                host_to_device(src, device),
                host_to_device(rows[valid], device),
            )
        queries.append(query)
    return _LengthGroup(chunk, host_to_device(keys, device), (queries[0], queries[1]))


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
        params,
        "_grpo_cp_layout",
        q.device,
        lambda b: _layout(b, size, rank, q.size(0), q.device),
    )
    # [C * T_local, n_kv, d], rank-major; backward reduce-scatters the gradients
    kg, vg = (gather_from_sequence_parallel_region(x, True, group) for x in (k, v))
    return _attend(q, kg, vg, groups, sdpa)


def _attend(
    q: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, groups: list[_LengthGroup], sdpa: SDPA
) -> torch.Tensor:
    """Local queries ``q [T_local, n_q, d]`` against the gathered ``kg, vg [C * T_local, n_kv,
    d]`` (rank-major): a fixed number of SDPA calls per group, none per document."""
    heads = q.size(1) // kg.size(1)
    out = q.new_zeros(q.shape)
    for g in groups:
        kb, vb = (x[g.key_index].transpose(1, 2) for x in (kg, vg))  # [B, n_kv, L, d]
        for qd in g.queries:
            qb = q[qd.rows].transpose(1, 2)  # [B, n_q, chunk, d]
            kp, vp = kb[:, :, : qd.prefix], vb[:, :, : qd.prefix]
            if qd.mask is None:
                ob = sdpa(qb, kp, vp, causal_lower_right(g.chunk, qd.prefix))
            else:
                if heads > 1:  # GQA with a mask tensor would fall back to SDPA's math kernel
                    kp, vp = (_repeat_heads(x, heads) for x in (kp, vp))
                ob = sdpa(qb, kp, vp, qd.mask)
            ob = ob.transpose(1, 2).reshape(-1, *q.shape[1:])
            if qd.src is not None:
                ob = ob.index_select(0, qd.src)
            out = out.index_put((qd.dst,), ob)
    return out


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, n_kv, L, d]`` -> ``[B, n_kv * heads, L, d]``, head h reading head ``h // heads``
    (``repeat_interleave``, as SDPA's ``enable_gqa``)."""
    b, n, length, d = x.shape
    return x[:, :, None].expand(b, n, heads, length, d).reshape(b, n * heads, length, d)
