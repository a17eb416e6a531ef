"""Causal attention over packed (THD) documents in one masked SDPA call: the pure-torch path
whose kernel count does not depend on the documents (where ``varlen_attn`` cannot run).

The ``T`` packed tokens are cut into ``nb`` query blocks of ``B`` tokens, ``B`` the longest
document rounded up to a power of two (at least ``MIN_BLOCK``). A query of block ``b`` can only
see keys of its own document, all within ``[b B - W, (b + 1) B)`` with ``W`` = the longest
document minus one rounded up to ``B`` (the previous block, or none). So each block attends to a
window of ``B + W`` gathered keys under a boolean mask (same document and key <= query): one
gather per input, one SDPA over ``[nb, n, B, B + W]``, whatever the number of distinct lengths.
It spends ``(B + W) / mean causal span`` times the FLOPs of exact per-document attention (about
3-6x on mixed lengths), the price of no host work per layer.

The window index and mask are built on the device once per micro-batch (cached on the
``PackedSeqParams`` next to :mod:`.packed`'s layout) and shared by every layer. Padding tokens
after the last bound form one more document (so no query row is empty) and get zeros.
Documents of one length (one long document included) skip the blocks: ``[N, L]`` viewed from the
input, one causal SDPA without a mask (no ``T x T`` mask for one long document).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_grpo.megatron.attention.packed import cached_layout

MIN_BLOCK = 16


@dataclass
class BlockLayout:
    """Query blocks and their key windows for ``tokens`` packed rows (device tensors)."""

    blocks: int  # nb
    block: int  # B
    window: int  # W: keys before the block a query may see
    keys: torch.Tensor | None  # int64 [nb * (B + W)]: rows of the front-padded K/V (W zeros first)
    mask: torch.Tensor | None  # bool [nb, 1, B, B + W]: True = attend; None: nb documents of B
    end: int  # tokens at or after it are padding (zeros out)


def _block_sizes(longest: int, tokens: int) -> tuple[int, int, int]:
    """(nb, B, W) for documents of at most ``longest`` tokens in ``tokens`` rows."""
    block = max(MIN_BLOCK, 1 << max(longest - 1, 0).bit_length())
    block = min(block, max(MIN_BLOCK, 1 << max(tokens - 1, 0).bit_length()))
    blocks = max(1, -(-tokens // block))
    window = -(-(longest - 1) // block) * block if longest > 1 and blocks > 1 else 0
    return blocks, block, window


def _layout(bounds: list[int], tokens: int, device: torch.device) -> BlockLayout:
    if bounds[-1] > tokens:
        raise ValueError(
            f"packed_seq_params: the documents end at token {bounds[-1]} but q holds {tokens}"
        )
    lens = {b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)}
    if len(lens) == 1 and min(lens) > 0:  # equal documents (or one): plain causal, no mask
        return BlockLayout(len(bounds) - 1, min(lens), 0, None, None, bounds[-1])
    longest = max(max(lens, default=0), tokens - bounds[-1])  # the padding is a document too
    nb, block, window = _block_sizes(longest, tokens)
    cu = torch.tensor(bounds[1:], dtype=torch.long, device=device)
    rows = nb * block
    # document of each row of the front-padded sequence: -1 (front), documents 0..N-1,
    # N (padding after the last bound), N + 1 (rows past T filling the last block)
    doc = torch.searchsorted(cu, torch.arange(rows, device=device), right=True)
    doc = torch.where(torch.arange(rows, device=device) < tokens, doc, len(cu) + 1)
    doc = torch.cat([doc.new_full((window,), -1), doc])
    span = block + window
    start = torch.arange(nb, device=device)[:, None] * block  # key j of block b: row bB - W + j
    keys = (start + torch.arange(span, device=device)[None, :]).flatten()  # in front-padded rows
    query = window + start + torch.arange(block, device=device)[None, :]  # [nb, B]
    key_doc = doc[keys].view(nb, 1, span)
    mask = (key_doc == doc[query][:, :, None]) & (keys.view(nb, 1, span) <= query[:, :, None])
    return BlockLayout(nb, block, window, keys, mask[:, None], bounds[-1])


def block_layout(params: PackedSeqParams, tokens: int, device: torch.device) -> BlockLayout:
    """The (cached) :class:`BlockLayout` of ``params`` for ``tokens`` packed rows."""
    return cached_layout(
        params, f"_grpo_block_layout_{tokens}", device, lambda b: _layout(b, tokens, device)
    )


def blocked_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    *,
    sdpa: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Per-document causal attention: ``q [T, n_q, d]``, ``k, v [T, n_kv, d]`` -> ``[T, n_q, d]``
    (zeros after the last bound). ``sdpa(q, k, v, mask)`` is the caller's SDPA on
    ``[nb, n, S, d]`` batches with a boolean ``mask`` (its GQA, dropout and softmax scale)."""
    tokens = q.size(0)
    lay = block_layout(params, tokens, q.device)
    if lay.mask is None:  # [end, n, d] -> [nb, n, B, d]: one causal SDPA, no mask
        qb, kb, vb = (
            x[: lay.end].view(lay.blocks, lay.block, *x.shape[1:]).transpose(1, 2)
            for x in (q, k, v)
        )
        out = sdpa(qb, kb, vb).transpose(1, 2).reshape(lay.end, *q.shape[1:])
        return F.pad(out, (0, 0, 0, 0, 0, tokens - lay.end))
    rows = lay.blocks * lay.block
    span = lay.block + lay.window
    groups = q.size(1) // k.size(1)
    if q.is_cuda and groups > 1:  # a masked SDPA with GQA only has the math kernel on CUDA
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    # [T, n, d] -> [nb, n, B, d]; K/V: W zero rows in front, windows gathered -> [nb, n, B + W, d]
    qb = F.pad(q, (0, 0, 0, 0, 0, rows - tokens)).view(lay.blocks, lay.block, *q.shape[1:])
    kb, vb = (
        F.pad(x, (0, 0, 0, 0, lay.window, rows - tokens))
        .index_select(0, lay.keys)
        .view(lay.blocks, span, *x.shape[1:])
        for x in (k, v)
    )
    out = sdpa(*(x.transpose(1, 2) for x in (qb, kb, vb)), lay.mask)
    out = out.transpose(1, 2).reshape(rows, *q.shape[1:])
    return F.pad(out[: lay.end], (0, 0, 0, 0, 0, tokens - lay.end))
