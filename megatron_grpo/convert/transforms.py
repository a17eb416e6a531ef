"""Tensor layout transforms between Hugging Face and Megatron (TP=1, i.e. checkpoint) layouts.

Every transform is a pair of pure functions ``to_mcore(hf_tensors) -> parts`` and
``to_hf(parts) -> hf_tensors``; they are exact inverses (bit-identical round trip).
``parts`` is one tensor, or two when megatron-core saves a gated ``linear_fc1`` as separate
gate (``w``) and up (``v``) shards (its swiglu sharded factory): then the gate and up tensors
pass through untouched, without a concatenated copy.

* ``identity``: one tensor, same layout.
* ``qkv``: ``q [n_heads * d, ...]``, ``k, v [n_groups * d, ...]`` -> ``[n_groups * (n_heads /
  n_groups + 2) * d, ...]``, interleaved per query group ``[q_1 .. q_m, k, v]`` (Megatron splits
  the fused projection per group, so a plain ``cat(q, k, v)`` is wrong whenever TP or GQA > 1).
* ``gate_up``: gate, up ``[F, H]`` -> ``[2F, H]`` (gate rows first), or the two parts as-is.
* ``vocab``: ``[V, H]`` -> ``[V_padded, H]`` zero-padded on import; padding rows trimmed on export.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_grpo.convert.errors import ConversionError


@dataclass(frozen=True)
class LayoutInfo:
    """The sizes the transforms need (from the model config)."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int


def _check_rows(t: torch.Tensor, rows: int, what: str) -> None:
    if t.shape[0] != rows:
        raise ConversionError(f"{what}: expected {rows} rows, got shape {tuple(t.shape)}")


def qkv_to_mcore(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: LayoutInfo
) -> torch.Tensor:
    """``q [nh*d, *rest]``, ``k, v [ng*d, *rest]`` -> ``[ng*(nh/ng+2)*d, *rest]`` per-group."""
    nh, ng, d = info.num_attention_heads, info.num_query_groups, info.head_dim
    _check_rows(q, nh * d, "q projection")
    _check_rows(k, ng * d, "k projection")
    _check_rows(v, ng * d, "v projection")
    rest = tuple(q.shape[1:])
    qg = q.reshape(ng, (nh // ng) * d, *rest)
    kg, vg = k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (nh // ng + 2) * d, *rest)


def qkv_to_hf(qkv: torch.Tensor, info: LayoutInfo) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`qkv_to_mcore`: ``[ng*(nh/ng+2)*d, *rest]`` -> ``(q, k, v)``."""
    nh, ng, d = info.num_attention_heads, info.num_query_groups, info.head_dim
    per_group = (nh // ng) * d
    _check_rows(qkv, ng * (per_group + 2 * d), "linear_qkv")
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(ng, per_group + 2 * d, *rest)
    q, k, v = torch.split(grouped, [per_group, d, d], dim=1)
    return (
        q.reshape(nh * d, *rest).contiguous(),
        k.reshape(ng * d, *rest).contiguous(),
        v.reshape(ng * d, *rest).contiguous(),
    )


def vocab_to_mcore(t: torch.Tensor, info: LayoutInfo) -> torch.Tensor:
    """``[V, H]`` -> ``[V_padded, H]`` with zero padding rows (never scored: ids >= V)."""
    _check_rows(t, info.vocab_size, "embedding / output layer (vocab_size)")
    pad = info.padded_vocab_size - info.vocab_size
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))], dim=0)


def vocab_to_hf(t: torch.Tensor, info: LayoutInfo) -> torch.Tensor:
    """``[V_ckpt, H]`` -> ``[V, H]``: drop the padding rows (V_ckpt may be padded for any TP)."""
    if t.shape[0] < info.vocab_size:
        raise ConversionError(
            f"embedding / output layer has {t.shape[0]} rows, fewer than vocab_size="
            f"{info.vocab_size}"
        )
    return t[: info.vocab_size].contiguous()


def _gate_up_to_mcore(hf: Sequence[torch.Tensor], num_parts: int) -> list[torch.Tensor]:
    if hf[0].shape != hf[1].shape:
        raise ConversionError(
            f"gate and up projections differ in shape: {tuple(hf[0].shape)} vs {tuple(hf[1].shape)}"
        )
    return list(hf) if num_parts == 2 else [torch.cat(list(hf), dim=0)]


def _gate_up_to_hf(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if len(parts) == 2:
        return list(parts)
    if parts[0].shape[0] % 2:
        raise ConversionError(f"linear_fc1 has an odd row count {parts[0].shape[0]}")
    return [p.contiguous() for p in torch.chunk(parts[0], 2, dim=0)]


ToMcore = Callable[[Sequence[torch.Tensor], LayoutInfo, int], list[torch.Tensor]]
ToHF = Callable[[Sequence[torch.Tensor], LayoutInfo], list[torch.Tensor]]


@dataclass(frozen=True)
class Transform:
    """A named HF <-> Megatron layout transform (see the module docstring).

    ``max_parts`` is 2 for transforms that may emit the (gate, up) parts of a swiglu-sharded
    ``linear_fc1`` instead of one fused tensor.
    """

    name: str
    num_hf: int
    forward: ToMcore
    inverse: ToHF
    max_parts: int = 1

    def to_mcore(
        self, hf: Sequence[torch.Tensor], info: LayoutInfo, num_parts: int = 1
    ) -> list[torch.Tensor]:
        """HF tensors -> ``num_parts`` Megatron tensors."""
        self._check_parts(num_parts)
        if len(hf) != self.num_hf:
            raise ConversionError(f"{self.name}: expected {self.num_hf} tensors, got {len(hf)}")
        return self.forward(hf, info, num_parts)

    def to_hf(self, parts: Sequence[torch.Tensor], info: LayoutInfo) -> list[torch.Tensor]:
        """Megatron tensor(s) -> HF tensors (inverse of :meth:`to_mcore`)."""
        self._check_parts(len(parts))
        return self.inverse(parts, info)

    def _check_parts(self, num_parts: int) -> None:
        if not 1 <= num_parts <= self.max_parts:
            raise ConversionError(f"transform {self.name} cannot produce {num_parts} parts")


IDENTITY = Transform("identity", 1, lambda hf, info, n: [hf[0]], lambda p, info: [p[0]])
QKV = Transform(
    "qkv",
    3,
    lambda hf, info, n: [qkv_to_mcore(*hf, info)],
    lambda p, info: list(qkv_to_hf(p[0], info)),
)
GATE_UP = Transform(
    "gate_up", 2, lambda hf, info, n: _gate_up_to_mcore(hf, n), lambda p, info: _gate_up_to_hf(p), 2
)
VOCAB = Transform(
    "vocab",
    1,
    lambda hf, info, n: [vocab_to_mcore(hf[0], info)],
    lambda p, info: [vocab_to_hf(p[0], info)],
)
