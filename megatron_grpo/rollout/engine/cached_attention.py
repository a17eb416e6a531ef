"""The attention of a generation call over the engine's KV cache (``kv_cache.KVCache``).

:class:`CachedAttention` replaces each layer's core attention (the portable ``SDPAttention`` or
Transformer Engine's) for the duration of a generation call:

* prefill (the ragged prompts packed into one ``[T, 1, n, d]`` stream): write each token's K/V
  at its (slot, position), then attend causally within each document
  (``megatron/attention/packed.py``, on the path ``attention/choice.py`` picks);
* decode (``[1, b, n, d]``, one new token per row): write K/V at each row's position, then
  attend to the row's cached keys. GQA folds the query heads of one KV head into the query
  length (``[b, n_kv, groups, d]`` against ``[b, n_kv, ctx, d]``), so no backend needs GQA
  support and K/V are never repeated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_grpo.megatron.attention.packed import packed_causal_attention
from megatron_grpo.megatron.attention.sdpa import sdpa
from megatron_grpo.ops.kernels import triton_kernels
from megatron_grpo.rollout.engine.kv_cache import KVCache


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
        out = packed_causal_attention(
            query[:, 0], key[:, 0], value[:, 0], c.packed, sdpa=self._sdpa
        )
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


def decode_attention(
    q: Tensor, kc: Tensor, vc: Tensor, cache: KVCache, scale: float, rows: slice | None = None
) -> Tensor:
    """One decode step's attention: ``q [b, n_kv, groups, d]`` (the query heads of each KV head
    as its query length) against row i's cached keys ``kc/vc[i, :, :pos_i + 1]`` ->
    ``[b, n_kv * groups * d]``: ``cache.attention`` "triton" reads exactly each row's keys
    (``kernels.decode_attention``, split-K); "sdpa" reads the ``ctx`` bucket under the step's
    mask (cuDNN on GPU). ``rows``: the step's rows these are (``kc/vc`` start at its first;
    None: all from row 0), whose positions and mask rows apply."""
    b, ctx = q.size(0), cache.ctx
    rows = slice(None) if rows is None else rows
    if cache.attention == "triton":
        pos = cache.write_pos[rows]
        out = triton_kernels.decode_attention(q.contiguous(), kc, vc, pos, ctx, scale)
        return out.reshape(b, -1)
    with _decode_backends(q.device):
        out = sdpa(q, kc[:b, :, :ctx], vc[:b, :, :ctx], mask=cache.mask[rows], scale=scale)
    return out.reshape(b, -1)


# Masked decode attention: cuDNN streams the cache near HBM bandwidth on Hopper (research file:
# 3.9-4.3 TB/s against 2.6 for flash and 0.15 for math); the others stay as fallbacks.
_DECODE_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.MATH,
]


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
