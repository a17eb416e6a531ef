"""Core attention through torch SDPA: causal, GQA, packed (THD) documents, context parallelism.

megatron-core's own "local" ``DotProductAttention`` materializes [b, heads, s, s] scores and
rejects packed sequences; :class:`SDPAttention` is its drop-in: packed documents attend per
document (:mod:`.choice`: one varlen_attn call, one masked SDPA over fixed blocks, or a few
length-bucketed SDPA calls), context parallelism all-gathers K
and V (:mod:`.cp`), and :func:`sdpa` is the package's one SDPA call (the decode engine's too).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_grpo.megatron.attention.choice import packed_attention
from megatron_grpo.megatron.attention.cp import cp_causal_attention
from megatron_grpo.megatron.attention.rope import RopedPackedSeqParams
from megatron_grpo.ops.kernels import check_choice

_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.no_mask)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The one SDPA call of the package: q ``[b, n_q, s_q, d]``, k/v ``[b, n_kv, s_k, d]`` ->
    ``[b, n_q, s_q, d]``, GQA without copying K/V where torch allows it.

    ``causal`` is torch's ``is_causal`` (top-left aligned: only for ``s_q == s_k``); ``mask`` is
    a boolean ``attn_mask`` (True = attend) broadcastable to ``[b, n_q, s_q, s_k]``."""
    groups = q.size(1) // k.size(1)
    extra = {}
    # fp32 on CUDA: no fused kernel takes GQA (flash and cuDNN need 16 bits, memory-efficient
    # no GQA), so expanded K/V reach memory-efficient instead of the math fallback
    if groups > 1 and _SDPA_HAS_GQA and not (q.is_cuda and q.dtype == torch.float32):
        extra["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale, **extra
    )


def dense_mask(
    s_q: int,
    s_k: int,
    mask_type: AttnMaskType,
    padding: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | bool | None:
    """The SDPA mask for unpacked ``[b, n, s, d]`` attention: ``True`` (plain causal, ``s_q ==
    s_k``), ``None`` (no mask) or a boolean ``[.., s_q, s_k]`` tensor (True = attend).

    Causal masks are aligned bottom-right: query ``i`` sees keys ``<= i + s_k - s_q``, so a
    KV-cached query (``s_q < s_k``, e.g. one decode token) sees the whole cache (torch's
    ``is_causal`` would align top-left and let it see key 0 only). ``padding`` is megatron's
    attention mask (True = masked out), e.g. a ``[b, 1, 1, s_k]`` key-padding mask."""
    causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
    if padding is None:
        if not causal or s_q == s_k:
            return True if causal else None
    allowed = None
    if causal:
        offset = s_k - s_q
        i = torch.arange(s_q, device=device)[:, None]
        allowed = torch.arange(s_k, device=device)[None, :] <= i + offset
    if padding is not None:
        keep = ~padding.to(device=device, dtype=torch.bool)
        allowed = keep if allowed is None else keep & allowed
    return allowed


class SDPAttention(MegatronModule):
    """Core attention through torch SDPA: causal, GQA, packed THD sequences per document.

    Drop-in for megatron-core's ``DotProductAttention`` (same constructor and forward
    signature). Shapes: unpacked ``q [s, b, n_q, d]``, ``k, v [s, b, n_kv, d]`` -> ``[s, b,
    n_q * d]``; packed (``packed_seq_params.qkv_format == "thd"``) ``q [t, n_q, d]``,
    ``k, v [t, n_kv, d]`` -> ``[t, n_q, d]``. Heads are this TP rank's heads. ``buckets``:
    ``LayerKernels.attention``; ``packed``: ``LayerKernels.packed_attention``; ``cp_group``: the
    context-parallel group (CP > 1), all given by the layer spec.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        buckets: str = "plan_free",
        cp_group=None,
        packed: str = "auto",
        **kwargs,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type not in _MASK_TYPES:
            raise ValueError(
                f"SDPAttention supports causal, padding_causal and no_mask, got {attn_mask_type}"
            )
        self.attn_mask_type = attn_mask_type
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("SDPAttention supports vanilla softmax without window attention")
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or config.softmax_scale or 1.0 / math.sqrt(head_dim)
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.buckets = check_choice("attention", buckets, "SDPAttention buckets")
        self.packed = check_choice("packed_attention", packed, "SDPAttention packed")
        if config.context_parallel_size > 1 and cp_group is None:
            raise ValueError("SDPAttention under context parallelism needs its cp_group")
        self.cp_group = cp_group

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object = None
    ) -> torch.Tensor:
        """q [b, n_q, s_q, d], k/v [b, n_kv, s_k, d] -> [b, n_q, s_q, d]; causal, or ``mask``
        (an SDPA ``attn_mask``, e.g. a lower-right causal bias) when given."""
        p = self.dropout_p if self.training else 0.0
        return sdpa(q, k, v, mask=mask, causal=mask is None, scale=self.softmax_scale, dropout_p=p)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        rng = tensor_parallel.get_cuda_rng_tracker().fork
        dropout = self.dropout_p > 0 and self.training and not self.config.sequence_parallel
        ctx = rng() if dropout else contextlib.nullcontext()
        with ctx:
            thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
            if isinstance(packed_seq_params, RopedPackedSeqParams):  # RoPE left to us
                query, key = packed_seq_params.rope.apply(query, key, packed_seq_params)
            if self.config.context_parallel_size > 1:
                if not thd:
                    raise ValueError(
                        "SDPAttention supports context parallelism on packed (THD) sequences "
                        "only (batch.split_for_context_parallel's layout)"
                    )
                return cp_causal_attention(
                    query, key, value, packed_seq_params, self.cp_group, sdpa=self._sdpa
                )
            if thd:
                p = self.dropout_p if self.training else 0.0
                return packed_attention(
                    query,
                    key,
                    value,
                    packed_seq_params,
                    impl=self.packed,
                    sdpa=self._sdpa,
                    scale=self.softmax_scale,
                    dropout_p=p,
                    buckets=self.buckets,
                )
            return self._dense(query, key, value, attention_mask, attn_mask_type)

    def _dense(self, query, key, value, attention_mask, attn_mask_type) -> torch.Tensor:
        """``[s, b, n, d]`` sequences under a causal or given mask -> ``[s, b, n * d]``."""
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # -> [b, n, s, d]
        mask = dense_mask(
            q.size(2), k.size(2), attn_mask_type or self.attn_mask_type, attention_mask, q.device
        )
        p = self.dropout_p if self.training else 0.0
        out = sdpa(
            q,
            k,
            v,
            mask=None if mask is True else mask,
            causal=mask is True,
            scale=self.softmax_scale,
            dropout_p=p,
        )
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
