"""Packed (THD) micro-batches: S sequences concatenated into T tokens, plus CP splitting.

Alignment convention: position ``t`` holds input token ``tokens[t]`` and predicts
``targets[t] = tokens[t + 1]`` of the same sequence. ``loss_mask[t]`` is True when that target
is a response (generated) token; the last position of every sequence has no target
(``loss_mask`` False). Per-token values (``old_logprobs``, ``ref_logprobs``,
``rollout_logprobs``, ``advantages``) are aligned with positions, i.e. with ``targets``.
``routes`` (MoE routing replay) belong to the *input* tokens: ``routes[t]`` is the top-k expert
selection the router made for ``tokens[t]``, not shifted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

_PER_TOKEN = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


@dataclass
class PackedBatch:
    """One packed micro-batch; every per-token tensor is ``[T]``, ``cu_seqlens`` ``[S+1]``."""

    tokens: Tensor  # [T] int64 input ids
    position_ids: Tensor  # [T] int64, restarting at 0 in every sequence
    targets: Tensor  # [T] int64 next-token ids (any valid id where loss_mask is False)
    loss_mask: Tensor  # [T] bool
    cu_seqlens: Tensor  # [S+1] int32 sequence boundaries, 0 .. T
    advantages: Tensor | None = None  # [T] float
    old_logprobs: Tensor | None = None  # [T] float
    ref_logprobs: Tensor | None = None  # [T] float
    rollout_logprobs: Tensor | None = None  # [T] float
    # [T, L, k] int64 expert ids per input token and MoE layer to replay; -1 rows: live routing
    routes: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max().item())

    def validate(self, vocab_size: int | None = None) -> None:
        """Shape/dtype checks with errors naming the tensor."""
        t = self.tokens.numel()
        for name in ("tokens", "position_ids", "targets", "loss_mask", *_PER_TOKEN):
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != (t,):
                raise ValueError(
                    f"PackedBatch.{name} must have shape [T]=[{t}], got {list(x.shape)}"
                )
        if self.routes is not None and (self.routes.dim() != 3 or self.routes.shape[0] != t):
            raise ValueError(
                f"PackedBatch.routes must have shape [T={t}, L, k], got {list(self.routes.shape)}"
            )
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"PackedBatch.loss_mask must be bool, got {self.loss_mask.dtype}")
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != t:
            raise ValueError(
                f"PackedBatch.cu_seqlens must be [S+1] from 0 to T={t}, got {cu.tolist()}"
            )
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError("PackedBatch.cu_seqlens must be non-decreasing")
        if vocab_size is not None:
            for name in ("tokens", "targets"):
                x = getattr(self, name)
                if x.numel() and (int(x.min()) < 0 or int(x.max()) >= vocab_size):
                    raise ValueError(f"PackedBatch.{name} has ids outside [0, {vocab_size})")

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), Tensor) else v)
            for f in dataclasses.fields(self)
        }
        return PackedBatch(**moved)


def pack_sequences(
    sequences: Sequence[Tensor],
    response_masks: Sequence[Tensor],
    *,
    advantages: Sequence[float] | Tensor | None = None,
    old_logprobs: Sequence[Tensor] | None = None,
    ref_logprobs: Sequence[Tensor] | None = None,
    rollout_logprobs: Sequence[Tensor] | None = None,
    routes: Sequence[Tensor] | None = None,
    pad_to_multiple_of: int = 1,
) -> PackedBatch:
    """Pack token sequences into a :class:`PackedBatch`.

    Args:
        sequences: S tensors ``[L_i]`` of token ids (prompt + response).
        response_masks: S bool tensors ``[L_i]``: True at generated tokens.
        advantages: one value per sequence (broadcast to its tokens).
        old_logprobs / ref_logprobs / rollout_logprobs: S tensors ``[L_i]`` aligned with the
            *tokens* (entry j = log-prob of token j; entry 0 is ignored); shifted here to the
            position convention of the module docstring.
        routes: S int tensors ``[L_i, L, k]``: expert ids per token (not shifted; -1 = live).
        pad_to_multiple_of: pad T with one extra all-masked sequence (e.g. the TP size under
            sequence parallelism).
    """
    _check_sequences(sequences, response_masks, pad_to_multiple_of)
    lens = [seq.numel() for seq in sequences]
    n = sum(lens)
    pad = -n % pad_to_multiple_of
    # One concatenation per field, then the shift by one position: the last position of every
    # sequence gets target 0 / loss_mask False (no per-sequence tensor ops).
    toks = _cat_as(sequences, torch.long)
    sizes = torch.tensor(lens)
    ends = sizes.cumsum(0)
    last = ends - 1
    targets = torch.cat([toks[1:], toks.new_zeros(1)]).index_fill_(0, last.to(toks.device), 0)
    masks = _cat_as(response_masks, torch.bool)
    masks = torch.cat([masks[1:], masks.new_zeros(1)]).index_fill_(0, last.to(masks.device), False)
    pos = torch.arange(n) - torch.repeat_interleave(ends - sizes, sizes, output_size=n)
    if pad:
        toks = torch.cat([toks, torch.zeros(pad, dtype=torch.long)])
        targets = torch.cat([targets, torch.zeros(pad, dtype=torch.long)])
        masks = torch.cat([masks, torch.zeros(pad, dtype=torch.bool)])
        pos = torch.cat([pos, torch.arange(pad)])
        lens.append(pad)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    extra = {}
    if advantages is not None:
        extra["advantages"] = _per_token_advantages(advantages, len(sequences), lens, pad)
    named = {"old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs}
    named["rollout_logprobs"] = rollout_logprobs
    for name, values in named.items():
        if values is not None:
            extra[name] = _shift_per_token(name, values, lens, pad)
    if routes is not None:
        extra["routes"] = _cat_routes(routes, lens, pad)
    return PackedBatch(toks, pos, targets, masks, cu, **extra)


def _check_sequences(
    sequences: Sequence[Tensor], response_masks: Sequence[Tensor], pad_to_multiple_of: int
) -> None:
    if len(sequences) != len(response_masks) or not sequences:
        raise ValueError("sequences and response_masks must be non-empty and of equal length")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    for i, (seq, rmask) in enumerate(zip(sequences, response_masks, strict=True)):
        if seq.dim() != 1 or rmask.shape != seq.shape or seq.numel() == 0:
            raise ValueError(f"sequence {i}: tokens and response mask must be equal [L_i], L_i > 0")


def _per_token_advantages(
    advantages: Sequence[float] | Tensor, count: int, lens: list[int], pad: int
) -> Tensor:
    """One value per sequence -> ``[T]`` (the padding sequence, when ``pad``, gets 0)."""
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    if adv.shape != (count,):
        raise ValueError(f"advantages must have one value per sequence, got {list(adv.shape)}")
    return torch.repeat_interleave(
        torch.cat([adv, adv.new_zeros(int(pad > 0))]), torch.tensor(lens)
    )


def _cat_as(parts: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """``torch.cat`` of ``parts`` converted to ``dtype``: one conversion after the cat when they
    share a dtype (the values of converting each part first), else one per part."""
    if len({p.dtype for p in parts}) == 1:
        return torch.cat(list(parts)).to(dtype)
    return torch.cat([p.to(dtype) for p in parts])


def _cat_routes(routes: Sequence[Tensor], lens: list[int], pad: int) -> Tensor:
    if len(routes) != len(lens) - int(pad > 0):
        raise ValueError("routes must have one tensor per sequence")
    for i, r in enumerate(routes):
        if r.dim() != 3 or r.shape[0] != lens[i] or r.shape[1:] != routes[0].shape[1:]:
            raise ValueError(
                f"routes[{i}] must have shape [{lens[i]}, L, k] like routes[0], got {list(r.shape)}"
            )
    out = _cat_as(routes, torch.long)
    if pad:
        out = torch.cat([out, torch.full((pad, *routes[0].shape[1:]), -1, dtype=torch.long)])
    return out


def _shift_per_token(name: str, values: Sequence[Tensor], lens: list[int], pad: int) -> Tensor:
    for i, v in enumerate(values):
        if v.shape != (lens[i],):
            raise ValueError(f"{name}[{i}] must have shape [{lens[i]}], got {list(v.shape)}")
    if len(values) != len(lens) - int(pad > 0):
        raise ValueError(f"{name} must have one tensor per sequence")
    # entry j of sequence i moves to position j - 1; each sequence's last position gets 0
    flat = _cat_as(values, torch.float32)
    last = torch.tensor(lens[: len(values)]).cumsum(0) - 1
    out = torch.cat([flat[1:], flat.new_zeros(1)]).index_fill_(0, last.to(flat.device), 0.0)
    return torch.cat([out, torch.zeros(pad)]) if pad else out


def packed_seq_params(batch: PackedBatch) -> PackedSeqParams:
    """Megatron's ``PackedSeqParams`` (``qkv_format="thd"``) for an unsplit batch."""
    cu = batch.cu_seqlens.to(torch.int32)
    longest = batch.max_seqlen
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def thd_partition_index(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Token indices of CP rank ``cp_rank`` in a packed batch (TE's THD load-balanced layout).

    Every sequence (padded length a multiple of ``2 * cp_size``) is cut into ``2 * cp_size``
    chunks; rank r keeps chunks r and ``2 * cp_size - 1 - r``, as
    ``transformer_engine``'s ``thd_get_partitioned_indices`` and megatron-core's THD RoPE
    (``_get_thd_freqs_on_this_cp_rank``) expect. Returns int64 ``[T_padded / cp_size]``.
    """
    cu = cu_seqlens_padded.to(device="cpu", dtype=torch.long)
    c2 = 2 * cp_size
    lens = cu[1:] - cu[:-1]
    bad = lens % c2 != 0
    if bool(bad.any()):
        raise ValueError(f"padded sequence length {int(lens[bad][0])} not divisible by 2*CP")
    # Sequence i contributes 2 * chunk_i tokens: j < chunk_i from chunk cp_rank, the rest from
    # chunk 2 * cp_size - 1 - cp_rank. No per-sequence loop: positions from index arithmetic.
    chunk = lens // c2
    count = 2 * chunk.clamp(min=0)
    total = int(count.sum())
    seg = torch.repeat_interleave(torch.arange(lens.numel()), count, output_size=total)
    c = chunk[seg]
    j = torch.arange(total) - (count.cumsum(0) - count)[seg]
    second = j >= c
    offset = torch.where(second, (c2 - 1 - cp_rank) * c + (j - c), cp_rank * c + j)
    return cu[:-1][seg] + offset


def padded_layout(batch: PackedBatch, cp_size: int, multiple: int = 1) -> tuple[Tensor, Tensor]:
    """Per-sequence padding to a multiple of ``2 * cp_size * multiple``.

    Returns ``(cu_seqlens_padded [S+1], dest [T])``: ``dest[t]`` is token t's position in the
    padded layout.
    """
    step = 2 * cp_size * multiple
    lens = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long()
    padded = (lens + step - 1) // step * step
    cu_pad = torch.zeros_like(batch.cu_seqlens)
    cu_pad[1:] = padded.cumsum(0)
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens, output_size=batch.num_tokens)
    start = batch.cu_seqlens[:-1].long()[seg]
    dest = torch.arange(batch.num_tokens) - start + cu_pad[:-1].long()[seg]
    return cu_pad, dest


def split_for_context_parallel(
    batch: PackedBatch, cp_size: int, cp_rank: int, multiple: int = 1
) -> tuple[PackedBatch, PackedSeqParams, Tensor]:
    """This CP rank's share of ``batch`` and the PackedSeqParams Megatron/TE expect.

    Every sequence is padded (masked tokens) to a multiple of ``2 * cp_size * multiple``
    (``multiple`` = TP size under sequence parallelism), then split with
    :func:`thd_partition_index`. The returned local batch has local ``cu_seqlens``
    (``cu_seqlens_padded / cp_size``: each rank holds a slice of all S sequences, the layout
    the loss's ``cp_group`` reductions expect). ``PackedSeqParams`` carries the global
    ``cu_seqlens`` and ``cu_seqlens_padded``. Also returns the index into the padded batch.
    """
    cu_pad, dest = padded_layout(batch, cp_size, multiple)
    lens = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long()
    padded = (cu_pad[1:] - cu_pad[:-1]).long()
    total = int(cu_pad[-1])
    index = thd_partition_index(cu_pad, cp_size, cp_rank)
    local = {}
    for f in dataclasses.fields(batch):
        x = getattr(batch, f.name)
        if f.name == "cu_seqlens" or x is None:
            continue
        # routes of padding tokens: -1 (live routing); other fields: 0
        full = x.new_full((total, *x.shape[1:]), -1 if f.name == "routes" else 0)
        full[dest] = x
        if f.name == "position_ids":  # positions continue through the padding
            seg = torch.repeat_interleave(torch.arange(lens.numel()), padded, output_size=total)
            full = torch.arange(total) - cu_pad[:-1].long()[seg]
        local[f.name] = full[index]
    local_cu = (cu_pad // cp_size).to(torch.int32)
    longest = int(padded.max())
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens.to(torch.int32),
        cu_seqlens_kv=batch.cu_seqlens.to(torch.int32),
        cu_seqlens_q_padded=cu_pad.to(torch.int32),
        cu_seqlens_kv_padded=cu_pad.to(torch.int32),
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return PackedBatch(cu_seqlens=local_cu, **local), params, index
