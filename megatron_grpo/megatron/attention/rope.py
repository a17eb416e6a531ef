"""RoPE of packed (THD) micro-batches in one op per tensor and layer, not one per document.

megatron-core (0.14-0.19) applies RoPE to packed sequences in a Python loop over the documents,
at every layer, for q and k, forward and backward (``_apply_rotary_pos_emb_thd``): hundreds of
small kernels per layer on a batch of short rollouts. The portable spec's attention
(:class:`PackedRopeSelfAttention`) instead hands the rotary table to the core attention, which
gathers ``cos`` / ``sin`` at each token's position (:func:`packed_positions`, megatron's
positions, context-parallel halves included) once per micro-batch and applies
:func:`megatron_grpo.ops.layers.rope.apply_rotary` to q and k: the same formula, mscale (YaRN),
interleaving and partial rotary, equal bit for bit in the torch reference.

The choice is data: ``PackedRopeSelfAttention.packed_rope`` is one of the ``rope`` names of
:data:`megatron_grpo.ops.kernels.CHOICES` ("auto", "torch", "triton", or "megatron" =
megatron-core's own loop, the baseline): ``LayerKernels.rope``, given by the layer spec.

Qwen3-style q / k RMSNorms fuse with the RoPE (``LayerKernels.qk_norm_rope``,
:func:`fuses_qk_norm`): the attention then applies
:func:`megatron_grpo.ops.layers.qk_norm_rope.qk_norm_rope` right after megatron-core's QKV split,
with the norms deferred (``Norm.deferred``), and hands the core attention rotated q and k.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import attention as mcore_attention
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megatron_grpo.loss.segments import host_to_device
from megatron_grpo.megatron.attention.packed import (
    cached_layout,
    copy_host_bounds,
    static_max_len,
)
from megatron_grpo.ops.kernels import check_choice, resolve_impl
from megatron_grpo.ops.layers.qk_norm_rope import qk_norm_rope
from megatron_grpo.ops.layers.rope import apply_rotary


def packed_positions(
    bounds: list[int], tokens: int, cp_size: int = 1, cp_rank: int = 0, device=None
) -> Tensor:
    """Each local token's position in its document, as megatron-core's THD RoPE assigns it.

    ``bounds``: the documents' (padded) ``cu_seqlens`` of the whole batch; the local tensor holds
    ``tokens`` rows: document i's ``(b[i+1] - b[i]) / cp_size`` tokens in turn, made of the two
    halves (chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``) of the load-balanced CP split.
    Rows after the last document (padding) get position 0. Returns int64 ``[tokens]`` on
    ``device`` (None: the host), computed there: a 32k-token search on a slow host took ms.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    cu = host_to_device(torch.tensor(bounds, dtype=torch.long), device)
    return cu_positions(cu, tokens, cp_size, cp_rank)


def cu_positions(cu: Tensor, tokens: int, cp_size: int = 1, cp_rank: int = 0) -> Tensor:
    """:func:`packed_positions` of the bounds ``cu [S+1]`` (any integer dtype) where they are,
    with no host read: kernels only (a captured forward's static bounds)."""
    device = cu.device
    cu = cu.long() // cp_size
    j = torch.arange(tokens, device=device)
    doc = torch.searchsorted(cu[1:], j, right=True)  # first document ending after j
    inside = doc < cu.numel() - 1
    doc = doc.clamp(max=max(cu.numel() - 2, 0))
    off = j - cu[doc] if cu.numel() > 1 else torch.zeros_like(j)
    if cp_size > 1:
        local = cu[doc + 1] - cu[doc]
        half = local // 2
        back = cp_size * local - (cp_rank + 1) * half + off - half
        off = torch.where(off < half, cp_rank * half + off, back)
    return torch.where(inside, off, 0)


@dataclass(eq=False)
class PackedRope:
    """The rotary tables of one micro-batch's forward, applied by the core attention."""

    q_freqs: Tensor  # [S_max, 1, 1, ROT] fp32: megatron-core's RotaryEmbedding output
    k_freqs: Tensor
    mscale: float  # YaRN's concentration factor, as megatron-core's attention applies it
    interleaved: bool
    impl: str  # "auto" | "torch" | "triton"
    cp_size: int
    cp_rank: int
    _tables: dict = field(default_factory=dict, repr=False)

    def apply(
        self, query: Tensor, key: Tensor, params: PackedSeqParams, qk_norm: tuple | None = None
    ) -> tuple[Tensor, Tensor]:
        """RoPE of ``query [T, n_q, d]`` and ``key [T, n_kv, d]``; ``qk_norm``: the layer's q and
        k RMSNorm modules, applied first in the same op (q and k sharing one rotary table)."""
        qc, qs = self._table(self.q_freqs, query, params)
        if qk_norm is not None:
            qn, kn = qk_norm
            return qk_norm_rope(
                query,
                key,
                qn.weight,
                kn.weight,
                qn.eps,
                qc,
                qs,
                interleaved=self.interleaved,
                impl=self.impl,
            )
        kc, ks = (
            (qc, qs) if self.k_freqs is self.q_freqs else self._table(self.k_freqs, key, params)
        )
        query = apply_rotary(query, qc, qs, interleaved=self.interleaved, impl=self.impl)
        key = apply_rotary(key, kc, ks, interleaved=self.interleaved, impl=self.impl)
        return query, key

    def _table(self, freqs: Tensor, x: Tensor, params: PackedSeqParams) -> tuple[Tensor, Tensor]:
        """``cos, sin [T, ROT]`` in ``x``'s dtype at each token's position (cached)."""
        key = (id(freqs), x.dtype, x.device)
        if key not in self._tables:
            pos = _positions(params, x.size(0), freqs.size(0), self.cp_size, self.cp_rank, x.device)
            table = freqs.reshape(freqs.size(0), -1)  # [S_max, ROT]
            # megatron-core: (cos(freqs) * mscale).to(dtype), per element
            cos = (torch.cos(table) * self.mscale).to(x.dtype)[pos]
            sin = (torch.sin(table) * self.mscale).to(x.dtype)[pos]
            self._tables[key] = (cos, sin)
        return self._tables[key]


def _positions(
    params: PackedSeqParams, tokens: int, rows: int, cp_size: int, cp_rank: int, device
) -> Tensor:
    """:func:`packed_positions` of ``params`` on ``device`` (cached on ``params``); an error when
    a document is longer than the rotary table (megatron-core would fail on it too). Static
    ``params`` (a captured forward) compute them from the device bounds at every forward."""
    longest = static_max_len(params)
    if longest is not None:
        if longest > rows:
            raise ValueError(
                f"static packed_seq_params: documents up to {longest} tokens but the rotary "
                f"table has {rows} rows"
            )
        return cu_positions(params.cu_seqlens_q, tokens, cp_size, cp_rank)

    def build(bounds: list[int]) -> Tensor:
        longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)), default=0)
        if longest > rows:
            raise ValueError(
                f"packed_seq_params: a document of {longest} tokens but the rotary table has "
                f"{rows} rows (max_seqlen_q={params.max_seqlen_q} is below the longest document)"
            )
        return packed_positions(bounds, tokens, cp_size, cp_rank, device)

    return cached_layout(params, f"_grpo_rope_positions_{tokens}", device, build)


@dataclass(eq=False)
class RopedPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` that carry the RoPE the core attention still has to apply."""

    rope: PackedRope | None = None


def is_thd(params: PackedSeqParams | None) -> bool:
    return params is not None and params.qkv_format == "thd"


def supports(config: TransformerConfig) -> bool:
    """Whether the model's RoPE is the plain / YaRN / partial / interleaved kind handled here
    (multi-latent attention and multimodal RoPE stay on megatron-core's path)."""
    return not config.multi_latent_attention and getattr(config, "mrope_section", None) is None


def _mscale(config: TransformerConfig) -> float:
    # megatron-core >= 0.16 scales cos / sin by YaRN's concentration factor in the attention;
    # 0.14 / 0.15 do not (their YaRN folds it elsewhere).
    factor = getattr(mcore_attention, "_yarn_get_concentration_factor_from_config", None)
    return 1.0 if factor is None else float(factor(config))


def roped_params(
    params: PackedSeqParams,
    emb: Tensor | tuple[Tensor, Tensor],
    config: TransformerConfig,
    impl: str,
    cp_rank: int = 0,
) -> RopedPackedSeqParams:
    """``params`` carrying the RoPE of ``emb`` (cached on ``params``: every layer and the
    recompute in backward get the same object, hence the same position and cos / sin tables);
    ``cp_rank``: this rank's context-parallel rank (its halves of each document)."""
    q_freqs, k_freqs = emb if isinstance(emb, tuple) else (emb, emb)
    cached = params.__dict__.get("_grpo_roped")
    if cached is not None and cached[0] is q_freqs and cached[1] is k_freqs and cached[2] == impl:
        return cached[3]
    cp = config.context_parallel_size
    rope = PackedRope(
        q_freqs,
        k_freqs,
        _mscale(config),
        bool(config.rotary_interleaved),
        impl,
        cp,
        cp_rank if cp > 1 else 0,
    )
    # A copy of the fields (no __post_init__: nothing is recomputed), plus the rope.
    roped = RopedPackedSeqParams.__new__(RopedPackedSeqParams)
    roped.__dict__.update({f.name: getattr(params, f.name) for f in dataclasses.fields(params)})
    roped.rope = rope
    copy_host_bounds(params, roped)
    params.__dict__["_grpo_roped"] = (q_freqs, k_freqs, impl, roped)
    return roped


def fuses_qk_norm(choice: str, rope_impl: str, norm_impl: str, device_type: str) -> bool:
    """THE decision of whether a packed forward runs the q / k RMSNorms and RoPE as one op:
    ``choice`` "fused" / "separate" as asked; "auto" where RoPE (``rope_impl``) and the norms
    (``norm_impl``) would both run Triton kernels on ``device_type`` (on the torch reference the
    fused op is the same ops in turn, so nothing is saved)."""
    check_choice("qk_norm_rope", choice)
    if choice != "auto":
        return choice == "fused"
    return all(resolve_impl(impl, device_type) == "triton" for impl in (rope_impl, norm_impl))


def _fusable_norms(attn: SelfAttention, packed_rope: str) -> tuple | str:
    """``(q_layernorm, k_layernorm)`` when the fused op can apply them, else why not."""
    if packed_rope == "megatron":
        return "packed_rope is 'megatron' (megatron-core's own RoPE)"
    if not supports(attn.config):
        return "the model's RoPE stays on megatron-core's path (multi-latent or multimodal)"
    norms = (attn.q_layernorm, attn.k_layernorm)
    for norm in norms:  # the portable spec's Norm (model/layers.py) in its RMSNorm form
        if not hasattr(norm, "deferred") or getattr(norm, "normalization", None) != "RMSNorm":
            return f"the q / k norms are {type(norm).__name__}, not the portable spec's RMSNorm"
    if norms[0].eps != norms[1].eps:
        return f"the q / k norms' eps differ ({norms[0].eps} and {norms[1].eps})"
    return norms


class PackedRopeSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention``; on packed (THD) batches outside inference its RoPE is
    left to the core attention (``RopedPackedSeqParams``), one op per tensor instead of
    megatron-core's per-document loop. ``packed_rope`` ("auto" | "torch" | "triton" |
    "megatron": ``LayerKernels.rope``) picks the path; "megatron" keeps megatron-core's.
    ``qk_norm_rope`` ("auto" | "fused" | "separate": ``LayerKernels.qk_norm_rope``): whether the
    q / k RMSNorms and that RoPE run as one op after the QKV split instead (:func:`fuses_qk_norm`).
    ``cp_rank``: the context-parallel rank (all given by the layer spec)."""

    def __init__(
        self,
        *args,
        packed_rope: str = "auto",
        qk_norm_rope: str = "auto",
        cp_rank: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.packed_rope = check_choice("rope", packed_rope, "packed_rope")
        self.qk_norm_rope = check_choice("qk_norm_rope", qk_norm_rope)
        self.cp_rank = cp_rank
        self._qk_norms = _fusable_norms(self, self.packed_rope)
        if qk_norm_rope == "fused" and isinstance(self._qk_norms, str):
            raise ValueError(f"layer_kernels.qk_norm_rope='fused' cannot apply: {self._qk_norms}")
        self._qk_pending: RopedPackedSeqParams | None = None

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        emb, params = kwargs.get("rotary_pos_emb"), kwargs.get("packed_seq_params")
        if (
            self.packed_rope != "megatron"
            and emb is not None
            and is_thd(params)
            and kwargs.get("inference_context") is None
            and supports(self.config)
        ):
            kwargs["rotary_pos_emb"] = None
            roped = roped_params(params, emb, self.config, self.packed_rope, self.cp_rank)
            if self._fuse(emb, hidden_states.device.type):
                return self._forward_fused(roped, hidden_states, *args, **kwargs)
            kwargs["packed_seq_params"] = roped
        return super().forward(hidden_states, *args, **kwargs)

    def _fuse(self, emb: Tensor | tuple, device_type: str) -> bool:
        if isinstance(self._qk_norms, str):
            return False
        if isinstance(emb, tuple) and emb[0] is not emb[1]:  # the op rotates q and k alike
            if self.qk_norm_rope == "fused":
                raise ValueError(
                    "layer_kernels.qk_norm_rope='fused' needs one rotary table for q and k"
                )
            return False
        return fuses_qk_norm(
            self.qk_norm_rope, self.packed_rope, self._qk_norms[0].impl, device_type
        )

    def _forward_fused(self, roped: RopedPackedSeqParams, hidden_states: Tensor, *args, **kwargs):
        """megatron-core's forward, q and k normalized and rotated in one op right after the QKV
        split (:meth:`get_query_key_value_tensors`); the core attention gets the plain params."""
        self._qk_pending = roped
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self._qk_pending = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        roped = self._qk_pending
        if roped is None:
            return super().get_query_key_value_tensors(*args, **kwargs)
        q_norm, k_norm = self._qk_norms
        q_norm.deferred = k_norm.deferred = True  # called (hooks run) but returning their input
        try:
            out = super().get_query_key_value_tensors(*args, **kwargs)
        finally:
            q_norm.deferred = k_norm.deferred = False
        query, key = out[0].squeeze(1), out[1].squeeze(1)  # THD: [T, 1, n, d] -> [T, n, d]
        query, key = roped.rope.apply(query, key, roped, qk_norm=(q_norm, k_norm))
        return (query.unsqueeze(1), key.unsqueeze(1), *out[2:])
