"""The KV cache of the generation engine and the attention that reads and writes it.

One buffer ``kv [L, 2, slots + 1, n_kv, S, d]`` holds the keys (RoPE applied) and values of this
rank's L layers for ``slots`` sequences of up to S tokens; the extra last slot is scratch that
padding tokens write into. Rows are independent sequences at their own positions (no shared
offset, no left padding): a decode query attends to its own row's keys ``[0, pos]`` through a
key-padding mask, so ragged prompts decode exactly as if each ran alone.

:class:`CachedAttention` replaces each layer's core attention (the portable ``SDPAttention`` or
Transformer Engine's) for the duration of a generation call:

* prefill (the ragged prompts packed into one ``[T, 1, n, d]`` stream): write each token's K/V
  at its (slot, position), then attend causally within each document (``packed_attention``:
  a few length-bucketed SDPA calls);
* decode (``[1, b, n, d]``, one new token per row): write K/V at each row's position, then
  attend to the row's cached keys. GQA folds the query heads of one KV head into the query
  length (``[b, n_kv, groups, d]`` against ``[b, n_kv, ctx, d]``), so no backend needs GQA
  support and K/V are never repeated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_grpo.megatron.layer_spec import sdpa
from megatron_grpo.megatron.packed_attention import packed_causal_attention
from megatron_grpo.rollout.decode_ops import apply_rope


@dataclass(frozen=True)
class CacheShape:
    """Per-token KV size of this rank's model: ``layers * 2 * kv_heads * head_dim`` elements."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> CacheShape:
        cfg = model.config
        tp = cfg.tensor_model_parallel_size
        groups = cfg.num_query_groups or cfg.num_attention_heads
        if groups % tp:
            raise ValueError(f"num_query_groups={groups} is not divisible by TP={tp}")
        dtype = next(model.parameters()).dtype
        return cls(len(model.decoder.layers), groups // tp, cfg.kv_channels, dtype)

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.finfo(self.dtype).bits // 8
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


def slots_for_budget(shape: CacheShape, budget_gib: float, seq_len: int) -> int:
    """How many sequences of ``seq_len`` tokens fit in ``budget_gib``; an error if none does."""
    per_seq = shape.bytes_per_token * seq_len
    slots = int(budget_gib * 2**30) // per_seq
    if slots < 1:
        raise ValueError(
            f"rollout.kv_cache_gib={budget_gib} is too small for one sequence: {seq_len} tokens "
            f"x {shape.bytes_per_token} bytes per token = {per_seq / 2**30:.4f} GiB"
        )
    return slots


class KVCache:
    """The buffer plus the per-forward write/read plan that every layer's attention shares."""

    def __init__(self, shape: CacheShape, slots: int, seq_len: int, device) -> None:
        self.shape, self.slots, self.seq_len = shape, slots, seq_len
        # Zeroed: masked-out keys still enter the score GEMM, and a NaN bit pattern left in
        # unwritten memory would turn masked scores (NaN + -inf) and the output into NaN.
        self.kv = torch.zeros(
            shape.layers, 2, slots + 1, shape.kv_heads, seq_len, shape.head_dim,
            dtype=shape.dtype, device=device,
        )  # fmt: skip
        self.scratch = slots
        self.decoding = False
        self.packed: PackedSeqParams | None = None  # prefill: the documents of the stream
        self.write_slot: Tensor | None = None  # prefill: [T] slot of each packed token
        self.write_pos: Tensor | None = None  # prefill: [T]; decode: [b] position per row
        self.ctx = 0  # decode: keys [0, ctx) are read (a bucket >= every row's pos + 1)
        self.mask: Tensor | None = None  # decode: [b, 1, 1, ctx] keys each row may see
        # RoPE of this forward's tokens, ``[s, b, 1, rot_dim]`` cos and sin in the model dtype
        # (scaled by YaRN's factor), computed once per forward for every layer; None: no RoPE.
        self.rope: tuple[Tensor, Tensor] | None = None
        self.rotary_interleaved = False
        self.attention = "sdpa"  # decode attention: "sdpa" (masked, cuDNN) or "triton"

    def plan_prefill(self, packed: PackedSeqParams, write_slot: Tensor, write_pos: Tensor) -> None:
        self.decoding, self.packed = False, packed
        self.write_slot, self.write_pos = write_slot, write_pos

    def plan_decode(self, pos: Tensor, ctx: int) -> None:
        self.decoding, self.write_pos, self.ctx = True, pos, ctx
        # one mask for all layers: row r sees its keys [0, pos_r]
        self.mask = (torch.arange(ctx, device=pos.device)[None, :] <= pos[:, None])[:, None, None]

    def apply_rope(self, x: Tensor) -> Tensor:
        """megatron-core's unfused RoPE formula (``t * cos + rotate_half(t) * sin``, the rotary
        part first) with this forward's precomputed cos / sin: ``x [s, b, n, d]``."""
        if self.rope is None:
            return x
        return apply_rope(x, *self.rope, self.rotary_interleaved)

    def move_rows(self, src: list[int], dst: list[int], ctx: int) -> None:
        """Copy slots ``src`` to ``dst`` (the first ``ctx`` positions): compaction."""
        if not src:
            return
        s = torch.tensor(src, device=self.kv.device)
        d = torch.tensor(dst, device=self.kv.device)
        self.kv[:, :, d, :, :ctx] = self.kv[:, :, s, :, :ctx]


class CachedAttention(torch.nn.Module):
    """Layer ``index``'s core attention during generation (see the module docstring)."""

    def __init__(self, cache: KVCache, index: int, scale: float) -> None:
        super().__init__()
        self.cache, self.index, self.scale = cache, index, scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs) -> Tensor:
        kc, vc = self.cache.kv[self.index, 0], self.cache.kv[self.index, 1]
        if not self.cache.decoding:
            return self._prefill(query, key, value, kc, vc)
        return self._decode(query, key, value, kc, vc)

    def _prefill(self, query: Tensor, key: Tensor, value: Tensor, kc: Tensor, vc: Tensor):
        """``query [T, 1, n_q, d]``, ``key/value [T, 1, n_kv, d]`` -> ``[T, 1, n_q * d]``."""
        c = self.cache
        query, key = c.apply_rope(query), c.apply_rope(key)
        kc[c.write_slot, :, c.write_pos] = key[:, 0]
        vc[c.write_slot, :, c.write_pos] = value[:, 0]
        out = packed_causal_attention(query[:, 0], key[:, 0], value[:, 0], c.packed,
                                      sdpa=self._sdpa)  # fmt: skip
        return out.reshape(out.size(0), 1, -1)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        return sdpa(q, k, v, mask=mask, causal=mask is None, scale=self.scale)

    def _decode(self, query: Tensor, key: Tensor, value: Tensor, kc: Tensor, vc: Tensor):
        """``query [1, b, n_q, d]``, ``key/value [1, b, n_kv, d]`` -> ``[1, b, n_q * d]``."""
        b, n_q, d = query.size(1), query.size(2), query.size(3)
        c = self.cache
        n_kv, pos = key.size(2), c.write_pos
        query, key = c.apply_rope(query), c.apply_rope(key)
        rows = torch.arange(b, device=query.device)
        kc[rows, :, pos] = key[0]
        vc[rows, :, pos] = value[0]
        q = query[0].reshape(b, n_kv, n_q // n_kv, d)  # query heads grouped by KV head
        return decode_attention(q, kc, vc, c, self.scale).reshape(1, b, n_q * d)


def decode_attention(q: Tensor, kc: Tensor, vc: Tensor, cache: KVCache, scale: float) -> Tensor:
    """One decode step's attention: ``q [b, n_kv, groups, d]`` (the query heads of each KV head
    as its query length) against row i's cached keys ``kc/vc[i, :, :pos_i + 1]`` ->
    ``[b, n_kv * groups * d]``: ``cache.attention`` "triton" reads exactly each row's keys
    (``kernels.decode_attention``, split-K); "sdpa" reads the ``ctx`` bucket under the step's
    mask (cuDNN on GPU)."""
    b, ctx = q.size(0), cache.ctx
    if cache.attention == "triton":
        from megatron_grpo.kernels import decode_attention as kernel

        out = kernel(q.contiguous(), kc, vc, cache.write_pos, ctx, scale)
        return out.reshape(b, -1)
    with _decode_backends(q.device):
        out = sdpa(q, kc[:b, :, :ctx], vc[:b, :, :ctx], mask=cache.mask, scale=scale)
    return out.reshape(b, -1)


# Masked decode attention: cuDNN streams the cache near HBM bandwidth on Hopper (research file:
# 3.9-4.3 TB/s against 2.6 for flash and 0.15 for math); the others stay as fallbacks.
_DECODE_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
    SDPBackend.MATH,
]  # fmt: skip


def _decode_backends(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(_DECODE_BACKENDS, set_priority=True)


def softmax_scale(model: torch.nn.Module) -> float:
    cfg = model.config
    return cfg.softmax_scale or 1.0 / math.sqrt(cfg.kv_channels)


@contextlib.contextmanager
def attached(model: torch.nn.Module, cache: KVCache) -> Iterator[None]:
    """Every layer's core attention reads and writes ``cache`` inside the block."""
    layers = [layer.self_attention for layer in model.decoder.layers]
    saved = [attn.core_attention for attn in layers]
    scale = softmax_scale(model)
    try:
        for i, attn in enumerate(layers):
            attn.core_attention = CachedAttention(cache, i, scale)
        yield
    finally:
        for attn, core in zip(layers, saved, strict=True):
            attn.core_attention = core
