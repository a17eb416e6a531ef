"""GPT decoder layer specs: Transformer Engine's when it imports, else our portable spec.

megatron-core's own "local" spec has two gaps off the TE path: its ``DotProductAttention``
materializes [b, heads, s, s] scores in a CUDA buffer and rejects packed (THD) sequences, and
its torch norms (``WrappedTorchNorm``) refuse sequence parallelism. The portable spec closes both:

* :class:`~megatron_grpo.megatron.attention.rope.PackedRopeSelfAttention`: megatron-core's
  ``SelfAttention`` whose packed-sequence RoPE is one op per tensor (megatron-core loops over
  the documents at every layer); :class:`SDPAttention` applies it before attending.
* :class:`SDPAttention`: ``torch.nn.functional.scaled_dot_product_attention``, causal, GQA;
  packed sequences attend per document (``attention.choice``: one ``varlen_attn`` call, one
  masked SDPA over fixed blocks, or a few length-bucketed SDPA calls), so documents never see each other and no [T, T] mask or
  score matrix is built (on GPU SDPA picks a flash/memory-efficient kernel: O(s) memory).
  Context parallelism (Megatron's THD CP layout) all-gathers K and V (``cp_attention``).
* :class:`Norm`: LayerNorm / RMSNorm (fp32 math; RMSNorm as one Triton kernel each way on GPU)
  whose parameters carry ``sequence_parallel`` so that
  Megatron's ``finalize_model_grads`` all-reduces their gradients across TP under SP
  (q/k norms are summed across TP by name, as Megatron does).

Linear layers, MLP and MoE (router, aux loss, token dispatcher, ``SequentialMLP`` experts) are
megatron-core's own modules; the dense MLP's SwiGLU (:class:`SwiGLUMLP`) and RMSNorm run as one
kernel each way on GPU. Checkpoint keys match the TE spec (``sharded_state_dict_keys_map``),
so a torch_dist checkpoint moves between the two specs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_grpo.megatron.attention.choice import PACKED_IMPLS, packed_attention
from megatron_grpo.megatron.attention.cp import cp_causal_attention
from megatron_grpo.megatron.attention.packed import BUCKETS
from megatron_grpo.megatron.attention.rope import PackedRopeSelfAttention, RopedPackedSeqParams
from megatron_grpo.megatron.compat import define_te_general_gemm
from megatron_grpo.megatron.moe.grouped_experts import GroupedExperts
from megatron_grpo.megatron.moe.layers import moe_layer_pattern
from megatron_grpo.megatron.moe.local_dispatch import GroupedMoELayer
from megatron_grpo.ops.dispatch import IMPLS
from megatron_grpo.ops.grouped_mm import GROUPED_MM_IMPLS
from megatron_grpo.ops.rms_norm import rms_norm
from megatron_grpo.ops.swiglu import swiglu

try:
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:  # optional dependency
    HAVE_TE = False

define_te_general_gemm()  # megatron-core 0.16 without Transformer Engine (compat.py)

_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class Norm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) computed in float32; SP-aware.

    Parameters get ``sequence_parallel = config.sequence_parallel``: under SP each TP rank
    normalizes different tokens, so Megatron sums their gradients across the TP group.
    Input ``[..., hidden_size]``; the output keeps the input dtype. RMSNorm runs
    :func:`megatron_grpo.ops.rms_norm.rms_norm` with ``impl`` (a class default, "auto": the
    Triton kernels on CUDA; :func:`set_layer_impl` sets it per model).
    """

    impl: str = "auto"

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ) -> None:
        super().__init__()
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the portable spec")
        self.normalization = normalization or config.normalization
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"normalization must be LayerNorm or RMSNorm, got {self.normalization}"
            )
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return rms_norm(x, self.weight, self.eps, impl=self.impl)
        shape = (self.hidden_size,)
        y = F.layer_norm(x.float(), shape, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class _QuietSubclassNotice(logging.Filter):
    """megatron-core 0.14-0.16 log "Unknown MLP type ... Using default kwargs" once per layer for
    any MLP subclass; for :class:`SwiGLUMLP` the defaults are right (the default TP group)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_QuietSubclassNotice())


def fused_swiglu_applies(config: TransformerConfig) -> bool:
    """Whether megatron-core's MLP computes plain SwiGLU on a bias-free fc1 output (gated SiLU,
    no clamp, offset, fusion or FP8 storage): what :class:`SwiGLUMLP` replaces."""
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.add_bias_linear
        and not config.bias_activation_fusion
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and getattr(config, "glu_linear_offset", 0.0) == 0.0
        and not getattr(config, "activation_func_fp8_input_store", False)
        and config.fp8 is None
    )


class SwiGLUMLP(MLP):
    """megatron-core's dense ``MLP`` whose SwiGLU is :func:`megatron_grpo.ops.swiglu.swiglu`
    with ``impl`` (one Triton kernel each way on GPU instead of ~8 element-wise kernels); any
    other activation, or extra forward arguments, take megatron-core's own forward."""

    impl: str = "auto"

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        *args,
        pg_collection=None,
        is_mtp_layer: bool | None = None,
        **kwargs,
    ) -> None:
        # megatron-core 0.19 hands a subclass of MLP the layer's process groups (MLP itself
        # gets them through ``as_mlp_submodule``); older versions pass none (the default TP group)
        if pg_collection is not None:
            kwargs.setdefault("tp_group", pg_collection.tp)
        super().__init__(config, submodules, *args, **kwargs)
        self.fused_swiglu = fused_swiglu_applies(config)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if not self.fused_swiglu or args or any(v is not None for v in kwargs.values()):
            return super().forward(hidden_states, *args, **kwargs)
        x, _ = self.linear_fc1(hidden_states)  # [s, b, 2F / TP]; no bias (fused_swiglu)
        return self.linear_fc2(swiglu(x, impl=self.impl))


def set_layer_impl(model: torch.nn.Module | list[torch.nn.Module], impl: str) -> int:
    """Set the element-wise kernels ("auto" | "torch" | "triton") of every portable-spec
    :class:`Norm` (RMSNorm), :class:`SwiGLUMLP` and :class:`GroupedExperts` (its SwiGLU) of
    ``model`` (a module or the list of chunks); returns how many modules were set."""
    if impl not in IMPLS:
        raise ValueError(f"layer impl must be one of {IMPLS}, got {impl!r}")
    return _set_on(model, (Norm, SwiGLUMLP, GroupedExperts), "impl", impl)


def set_grouped_gemm_impl(model: torch.nn.Module | list[torch.nn.Module], impl: str) -> int:
    """The grouped GEMM of every :class:`GroupedExperts` of ``model`` (a module or the list of
    chunks): ``ops.grouped_mm.GROUPED_MM_IMPLS``; returns how many were set."""
    if impl not in GROUPED_MM_IMPLS:
        raise ValueError(f"grouped GEMM impl must be one of {GROUPED_MM_IMPLS}, got {impl!r}")
    return _set_on(model, (GroupedExperts,), "gemm_impl", impl)


def set_packed_buckets(model: torch.nn.Module | list[torch.nn.Module], buckets: str) -> int:
    """How every ``SDPAttention`` of ``model`` (a module or the list of chunks) runs packed
    documents of mixed lengths (``packed_attention.BUCKETS``); returns how many were set."""
    if buckets not in BUCKETS:
        raise ValueError(f"packed attention buckets must be one of {BUCKETS}, got {buckets!r}")
    return _set_on(model, (SDPAttention,), "buckets", buckets)


def set_packed_attention(model: torch.nn.Module | list[torch.nn.Module], impl: str) -> int:
    """The packed-document attention path (``attention.choice.PACKED_IMPLS``) of every
    ``SDPAttention`` of ``model`` (a module or the list of chunks); returns how many were set."""
    if impl not in PACKED_IMPLS:
        raise ValueError(f"packed attention impl must be one of {PACKED_IMPLS}, got {impl!r}")
    return _set_on(model, (SDPAttention,), "packed_impl", impl)


def _set_on(model: torch.nn.Module | list[torch.nn.Module], types: tuple, name: str, value) -> int:
    """Set attribute ``name`` of every module of ``types`` in ``model`` (or its chunks)."""
    chunks = model if isinstance(model, list) else [model]
    modules = [m for c in chunks for m in c.modules() if isinstance(m, types)]
    for m in modules:
        setattr(m, name, value)
    return len(modules)


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
    ``k, v [t, n_kv, d]`` -> ``[t, n_q, d]``. Heads are this TP rank's heads.
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
        self.buckets = "plan_free"  # packed_attention.BUCKETS; set_packed_buckets changes it
        self.packed_impl = "auto"  # attention.choice.PACKED_IMPLS; set_packed_attention

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
                group = parallel_state.get_context_parallel_group()
                return cp_causal_attention(
                    query, key, value, packed_seq_params, group, sdpa=self._sdpa
                )
            if thd:
                p = self.dropout_p if self.training else 0.0
                return packed_attention(
                    query,
                    key,
                    value,
                    packed_seq_params,
                    impl=self.packed_impl,
                    sdpa=self._sdpa,
                    scale=self.softmax_scale,
                    dropout_p=p,
                    buckets=self.buckets,
                )
            # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            mask = dense_mask(
                q.size(2),
                k.size(2),
                attn_mask_type or self.attn_mask_type,
                attention_mask,
                q.device,
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


def _attention_spec(qk_layernorm: bool) -> ModuleSpec:
    return ModuleSpec(
        module=PackedRopeSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=SDPAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=Norm if qk_layernorm else IdentityOp,
            k_layernorm=Norm if qk_layernorm else IdentityOp,
        ),
    )


def portable_layer_spec(config: TransformerConfig, moe: bool) -> ModuleSpec:
    """One decoder layer of the portable spec (dense MLP, or megatron-core MoE when ``moe``)."""
    if moe:
        mlp = get_moe_module_spec_for_backend(
            LocalSpecProvider(), num_experts=config.num_moe_experts, moe_grouped_gemm=False
        )
        if config.moe_grouped_gemm:  # SequentialMLP's drop-in: all local experts in 2 GEMMs
            mlp = _with_grouped_experts(mlp)
        # Same keys as the TE spec: only the attention norm is fused there for MoE layers.
        keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    else:
        mlp = ModuleSpec(
            module=SwiGLUMLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
        keys_map = {
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
        }
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm,
            self_attention=_attention_spec(config.qk_layernorm),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=Norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def _with_grouped_experts(mlp):
    """megatron-core's MoE layer spec as :class:`GroupedMoELayer` (the local dispatch where all
    experts are on the rank) with :class:`GroupedExperts`: a ``ModuleSpec`` (megatron-core <=
    0.18) or ``partial(MoELayer, submodules=...)`` (0.19)."""
    if isinstance(mlp, ModuleSpec):
        mlp.module = GroupedMoELayer
        mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
        return mlp
    submodules = dataclasses.replace(mlp.keywords["submodules"], experts=GroupedExperts)
    return functools.partial(
        GroupedMoELayer, *mlp.args, **{**mlp.keywords, "submodules": submodules}
    )


def decoder_block_spec(
    config: TransformerConfig, use_te: bool, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """The layers of this pipeline (and virtual) stage plus the final norm.

    ``use_te``: Transformer Engine's spec (megatron-core's ``get_gpt_decoder_block_spec``);
    otherwise the portable spec of this module.
    """
    if use_te:
        if not HAVE_TE:
            raise ValueError("transformer_impl 'transformer_engine' but it does not import")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    pattern = moe_layer_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    specs = {flag: portable_layer_spec(config, flag) for flag in set(pattern)}
    return TransformerBlockSubmodules(
        layer_specs=[specs[flag] for flag in pattern[offset : offset + count]], layer_norm=Norm
    )
