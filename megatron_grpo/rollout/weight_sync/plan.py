"""What travels in which bucket: the sender's global tensors cut into fixed-size byte buckets.

The sender's tensors (in its module order) are laid end to end and cut into buckets of at most
``bucket_bytes``. A tensor that does not fit the rest of a bucket is split along its axis 0 (rows;
experts for expert tensors), so a tensor larger than a bucket spans several, and many small ones
share one. A bucket exceeds ``bucket_bytes`` only when one row alone does (it then holds that row).
Each segment starts at a multiple of :data:`ALIGN` bytes so it can be viewed in its dtype.

Both sides compute the same buckets from the same :class:`TensorMeta` list (the sender's, sent
to the receivers once at setup and checked against their own tensors there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGN = 16  # bytes: any dtype's view of a uint8 bucket slice starting here is aligned

DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass(frozen=True)
class TensorMeta:
    """A global tensor as the sender sends it: key, shape (the sender's global shape), dtype
    name, and whether its rows are vocabulary rows (padded per TP size)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    vocab: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along axis 0 (the unit a tensor is split at)."""
        return math.prod(self.shape[1:]) * self.torch_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


@dataclass(frozen=True)
class Segment:
    """Rows ``[row0, row1)`` of tensor ``index`` at byte ``offset`` of its bucket."""

    index: int
    row0: int
    row1: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    segments: tuple[Segment, ...]
    nbytes: int  # the bytes that travel: up to the last segment's end


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Cut ``metas`` (in order) into buckets of at most ``bucket_bytes`` (module docstring)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    segments: list[Segment] = []
    used = end = 0  # the next segment's aligned offset; the last segment's end
    for i, meta in enumerate(metas):
        if meta.dtype not in DTYPES:
            raise ValueError(f"weight sync: {meta.key} has dtype {meta.dtype}, not one of {DTYPES}")
        row = meta.row_bytes
        r = 0
        while r < meta.shape[0]:
            take = min(meta.shape[0] - r, max(bucket_bytes - used, 0) // row) if row else 0
            if take == 0 and segments:  # the rest of this bucket holds not even one row
                buckets.append(Bucket(tuple(segments), end))
                segments, used = [], 0
                continue
            take = max(take, 1)  # an empty bucket takes at least one row
            segments.append(Segment(i, r, r + take, used))
            end = used + take * row
            used = _aligned(end)
            r += take
    if segments:
        buckets.append(Bucket(tuple(segments), end))
    return buckets


def check_metas(sent: list[TensorMeta], own: dict[str, TensorMeta]) -> None:
    """The receiver's tensors (``own`` by key, its global shapes) must be the sender's: same
    keys, dtypes and shapes (vocabulary rows may differ: padding). Errors name the tensor."""
    keys = [m.key for m in sent]
    missing = sorted(set(own) - set(keys))
    extra = sorted(set(keys) - set(own))
    if missing or extra:
        raise ValueError(
            "weight sync: the trainer's and the generator's models differ: "
            f"only the generator has {missing[:5]}, only the trainer has {extra[:5]}"
        )
    for m in sent:
        o = own[m.key]
        same = m.shape[1:] == o.shape[1:] and (m.vocab or m.shape[0] == o.shape[0])
        if not same or m.vocab != o.vocab:
            raise ValueError(
                f"weight sync: {m.key} has global shape {m.shape} on the trainer and "
                f"{o.shape} on the generator"
            )
        if m.dtype != o.dtype:
            raise ValueError(
                f"weight sync: {m.key} is {m.dtype} on the trainer and {o.dtype} on the "
                "generator (weights are copied bit for bit: build both in one params_dtype)"
            )
