"""Packed micro-batches padded to a few fixed shapes, so that a captured CUDA graph of a forward
replays for every micro-batch of its shape.

A graph replays fixed tensor sizes and kernel arguments: the token count ``T``, the number of
documents (the length of ``cu_seqlens``) and the longest document (the attention's grid and
the rotary table) are baked in when it is captured. :func:`graph_shape` rounds each up to a
bucket (tokens to 1/16 of their power of two, documents and the longest document to a power
of two) and :func:`pad_to_shape` fills a micro-batch up to it with padding documents: at least
one token each (no empty document reaches a kernel), every one masked out of the loss. Each
document still attends to itself only, so the real tokens' outputs are those of the unpadded
micro-batch; the padding costs at most 1/16 more tokens and the routed experts see it as
more tokens (dropless routing: no real token changes its experts). One call's micro-batches
take at most ``MAX_SHAPES`` shapes: past that, more documents and coarser token buckets (more
padding: 6.6% against 1.8% on 4k micro-batches of 520-1030-token documents, by arithmetic),
so that the shapes recur from step to step and their graphs are replayed, not captured again.
A micro-batch whose shape has no graph yet takes a larger shape that has one (or that another
micro-batch of the call brings) when its padding costs less GPU time than a capture's host time
(:class:`ShapeReuse`): the small last micro-batch of a schedule, a longest document just past
a power of two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_grpo.megatron.batch.packing import PackedBatch
from megatron_grpo.megatron.parallel import all_reduce_max

# tokens round up to a multiple of 2 ** (floor(log2 T) - TOKEN_STEPS_LOG2): at most 1/16 more
TOKEN_STEPS_LOG2 = 4
MIN_TOKENS = 128
# shapes one call's micro-batches may take. Mixed lengths gave an update schedule 16-21 of the
# finer buckets: more than a store keeps (``graph_store.MAX_GRAPHS``), so every shape was
# captured again in every step (one H200, the dense twin, 4k micro-batches of 520-1030-token
# documents: 32-42 captures a step, 0.7x the eager update's tokens/s).
MAX_SHAPES = 4


@dataclass(frozen=True)
class GraphShape:
    """The fixed shape of a captured forward's micro-batch."""

    tokens: int  # T: packed tokens
    docs: int  # S: documents, padding documents included (``cu_seqlens`` holds S + 1)
    max_len: int  # an upper bound of the longest document (the attention's and RoPE's)


@dataclass(frozen=True)
class ShapeReuse:
    """Shapes with a graph already, and what padding is worth not capturing another: a
    micro-batch whose own shape is new takes the one of these (or of the call's other new
    shapes) that adds the fewest padding tokens, if the tokens added over all the micro-batches
    of its shape are at most ``tokens`` (the GPU time of that many tokens against a capture's
    host time: :func:`~megatron_grpo.megatron.step.graph_plan.capture_padding_tokens`)."""

    captured: tuple[GraphShape, ...] = ()
    tokens: int = 0


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def round_tokens(n: int, multiple: int = 1, steps_log2: int = TOKEN_STEPS_LOG2) -> int:
    """``n`` rounded up to its token bucket (``2 ** steps_log2`` buckets per power of two), a
    multiple of ``multiple`` (the TP / SP multiple)."""
    n = max(n, MIN_TOKENS)
    step = 1 << max(n.bit_length() - 1 - steps_log2, 0)
    step = step * multiple // math.gcd(step, multiple)
    return -(-n // step) * step


def _lengths(batch: PackedBatch) -> list[int]:
    cu = batch.cu_seqlens.tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]


def docs_of(batch: PackedBatch) -> int:
    """The document bucket of ``batch``: room for its documents and one padding document."""
    return _pow2(batch.cu_seqlens.numel())  # S + 1 documents


def tokens_of(batch: PackedBatch, docs: int, multiple: int = 1) -> int:
    """The token bucket of ``batch`` padded to ``docs`` documents (each padding one >= 1 token)."""
    return round_tokens(batch.num_tokens + docs - (batch.cu_seqlens.numel() - 1), multiple)


def _padding_lengths(batch: PackedBatch, shape: GraphShape) -> list[int]:
    """The padding documents' lengths: ``docs - S`` documents sharing ``tokens - T`` evenly."""
    n = shape.docs - (batch.cu_seqlens.numel() - 1)
    pad = shape.tokens - batch.num_tokens
    if n < 1 or pad < n:
        raise ValueError(
            f"a micro-batch of {batch.num_tokens} tokens in {batch.cu_seqlens.numel() - 1} "
            f"documents does not fit the graph shape {shape} (it needs at least one padding "
            "document of one token or more)"
        )
    return [pad // n + (i < pad % n) for i in range(n)]


def fits(batch: PackedBatch, shape: GraphShape) -> bool:
    """Whether ``batch`` pads to ``shape``: a padding document of a token or more, none longer
    than ``shape.max_len`` (:func:`pad_to_shape` would raise otherwise)."""
    n = shape.docs - (batch.cu_seqlens.numel() - 1)
    if n < 1 or shape.tokens - batch.num_tokens < n:
        return False
    return max(_lengths(batch) + _padding_lengths(batch, shape)) <= shape.max_len


def max_len_of(batch: PackedBatch, shape: GraphShape) -> int:
    """The longest-document bucket of ``batch`` padded to ``shape`` (``tokens`` at most)."""
    longest = max(_lengths(batch) + _padding_lengths(batch, shape))
    return min(_pow2(longest), shape.tokens)


def graph_shapes(
    batches: Sequence[PackedBatch],
    multiple: int = 1,
    group: dist.ProcessGroup | None = None,
    most: int = MAX_SHAPES,
    reuse: ShapeReuse | None = None,
) -> list[GraphShape]:
    """The shape each of ``batches`` is padded to, at most ``most`` distinct ones: beyond
    that every batch takes the largest document count and the tokens coarser buckets (to one
    shape, the largest, at the end). ``group``: ranks that run these forwards as collectives
    with each other with batches of their own (MoE expert parallelism over DP): their i-th
    forwards get one shape, the largest of theirs (small all-reduces). Ranks of one TP group
    hold the same batches, hence the same shapes, without it. ``reuse``: shapes with graphs
    that new ones give way to (:class:`ShapeReuse`; the same on every rank of ``group``)."""

    def agree(values: list[int]) -> list[int]:
        return values if group is None else all_reduce_max(values, group, torch.int64)

    shapes = _budgeted_shapes(batches, multiple, most, agree)
    if reuse is None or reuse.tokens <= 0 or set(shapes) <= set(reuse.captured):
        return shapes
    return _reused(batches, shapes, reuse, agree)


def _budgeted_shapes(batches, multiple: int, most: int, agree) -> list[GraphShape]:
    """:func:`graph_shapes` without ``reuse``."""
    largest, fewest = agree([len(batches), -len(batches)])
    if largest != -fewest:  # else the ranks would agree on lists of different lengths: a hang
        raise ValueError(
            f"graph_shapes: the ranks of the group bring {-fewest} to {largest} micro-batches; "
            "their i-th forwards are collectives with each other, so each must run as many "
            "(the trainer's make_mini_batches(count_group=...) splits to the group's count)"
        )
    docs = agree([docs_of(b) for b in batches])
    tokens = agree([tokens_of(b, d, multiple) for b, d in zip(batches, docs, strict=True)])
    shapes = _with_lens(batches, tokens, docs, agree)
    if len(set(shapes)) <= most:
        return shapes
    top = max(docs)  # agreed: the same on every rank, so are the choices below
    need = agree([b.num_tokens + top - (b.cu_seqlens.numel() - 1) for b in batches])
    for steps in range(TOKEN_STEPS_LOG2 - 1, -1, -1):  # rounding is monotonic: max of rounded
        tokens = [round_tokens(n, multiple, steps) for n in need]
        shapes = _with_lens(batches, tokens, [top] * len(batches), agree, unify=True)
        if len(set(shapes)) <= most:
            return shapes
    tokens = [max(tokens)] * len(batches)
    return _with_lens(batches, tokens, [top] * len(batches), agree, unify=True)


def _reused(batches, shapes: list[GraphShape], reuse: ShapeReuse, agree) -> list[GraphShape]:
    """``shapes`` with each new one (smallest first) replaced by the candidate that fits all its
    batches on every rank (agreed) and adds the fewest padding tokens, if at most
    ``reuse.tokens``. Candidates: the captured shapes and the other new shapes still in use."""
    order = lambda s: (s.tokens, s.docs, s.max_len)  # noqa: E731
    new = sorted(set(shapes) - set(reuse.captured), key=order)
    candidates = sorted(set(reuse.captured) | set(new), key=order)
    misfit = agree([int(not fits(b, c)) for b in batches for c in candidates])
    column = {c: j for j, c in enumerate(candidates)}
    shapes = list(shapes)
    for s in new:
        rows = [i for i, x in enumerate(shapes) if x == s]
        best, cost = None, reuse.tokens + 1
        for c in sorted((set(reuse.captured) | set(shapes)) - {s}, key=order):
            if any(misfit[i * len(candidates) + column[c]] for i in rows):
                continue
            added = len(rows) * (c.tokens - s.tokens)
            if added < cost:
                best, cost = c, added
        if best is not None:
            shapes = [best if x == s else x for x in shapes]
    return shapes


def _with_lens(batches, tokens, docs, agree, unify: bool = False) -> list[GraphShape]:
    """The shapes of ``tokens`` and ``docs`` with each batch's longest-document bucket
    (agreed; ``unify``: the largest of all, capped at each shape's tokens)."""
    shapes = [GraphShape(t, d, t) for t, d in zip(tokens, docs, strict=True)]
    lens = agree([max_len_of(b, s) for b, s in zip(batches, shapes, strict=True)])
    if unify:
        lens = [min(max(lens), s.tokens) for s in shapes]
    return [GraphShape(s.tokens, s.docs, m) for s, m in zip(shapes, lens, strict=True)]


def pad_to_shape(batch: PackedBatch, shape: GraphShape) -> PackedBatch:
    """``batch`` with padding documents appended up to ``shape``: token 0, positions from 0 in
    each, no loss (``loss_mask`` False, per-token values 0), live routing (``routes`` -1).
    Its first ``batch.num_tokens`` positions are ``batch``'s."""
    lens = _padding_lengths(batch, shape)
    pad = sum(lens)
    if max(_lengths(batch) + lens) > shape.max_len:
        raise ValueError(f"a document of the micro-batch is longer than the graph shape {shape}")
    sizes = torch.tensor(lens)
    starts = sizes.cumsum(0) - sizes
    fields = {
        "tokens": torch.zeros(pad, dtype=batch.tokens.dtype),
        "position_ids": torch.arange(pad) - torch.repeat_interleave(starts, sizes),
        "targets": torch.zeros(pad, dtype=batch.targets.dtype),
        "loss_mask": torch.zeros(pad, dtype=torch.bool),
    }
    out = {}
    for name, tail in fields.items():
        x = getattr(batch, name)
        out[name] = torch.cat([x, tail.to(x.dtype)])
    for name in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
        x = getattr(batch, name)
        out[name] = None if x is None else torch.cat([x, x.new_zeros(pad)])
    if batch.routes is not None:
        r = batch.routes
        out["routes"] = torch.cat([r, r.new_full((pad, *r.shape[1:]), -1)])
    cu = batch.cu_seqlens
    tail = sizes.cumsum(0).to(cu.dtype) + cu[-1]
    out["cu_seqlens"] = torch.cat([cu, tail])
    return PackedBatch(**out)
