"""GPT decoder layer specs: Transformer Engine's when it imports, else our portable spec.

megatron-core's own "local" spec has two gaps off the TE path: its ``DotProductAttention``
materializes [b, heads, s, s] scores in a CUDA buffer and rejects packed (THD) sequences, and
its torch norms (``WrappedTorchNorm``) refuse sequence parallelism. The portable spec closes both:

* :class:`~megatron_grpo.megatron.attention.rope.PackedRopeSelfAttention`: megatron-core's
  ``SelfAttention`` whose packed-sequence RoPE is one op per tensor (megatron-core loops over
  the documents at every layer); :class:`SDPAttention` applies it before attending.
* :class:`~megatron_grpo.megatron.attention.sdpa.SDPAttention`: ``torch.nn.functional.scaled_dot_product_attention``, causal, GQA;
  packed sequences attend per document (``packed_attention``: a few length-bucketed SDPA calls,
  not one per document), so documents never see each other and no [T, T] mask or
  score matrix is built (on GPU SDPA picks a flash/memory-efficient kernel: O(s) memory).
  Context parallelism (Megatron's THD CP layout) all-gathers K and V (``cp_attention``).
* :class:`~megatron_grpo.megatron.model.layers.Norm`: LayerNorm / RMSNorm (fp32 math; RMSNorm as one Triton kernel each way on GPU)
  whose parameters carry ``sequence_parallel`` so that
  Megatron's ``finalize_model_grads`` all-reduces their gradients across TP under SP
  (q/k norms are summed across TP by name, as Megatron does).

Linear layers, MLP and MoE (router, aux loss, token dispatcher, ``SequentialMLP`` experts) are
megatron-core's own modules (the attention and dense MLP linears as
:mod:`~megatron_grpo.megatron.model.tp_overlap`'s subclasses where ``tp_overlap`` is ring / symm: their
sequence-parallel collectives overlapped with the GEMMs); the dense MLP's SwiGLU
(:class:`~.layers.SwiGLUMLP`) and RMSNorm run as one kernel each way on GPU. Checkpoint keys match the TE spec (``sharded_state_dict_keys_map``),
so a torch_dist checkpoint moves between the two specs.

The modules' kernels are one :class:`~megatron_grpo.ops.kernels.LayerKernels` value
(``ModelConfig.layer_kernels``), given to each module by the spec when the model is built.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
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

from megatron_grpo.megatron.attention.rope import PackedRopeSelfAttention
from megatron_grpo.megatron.attention.sdpa import SDPAttention
from megatron_grpo.megatron.compat import define_te_general_gemm
from megatron_grpo.megatron.model.layers import Norm, SwiGLUMLP
from megatron_grpo.megatron.model.tp_overlap import tp_linear_classes
from megatron_grpo.megatron.moe.grouped_experts import GroupedExperts
from megatron_grpo.megatron.moe.layers import moe_layer_pattern
from megatron_grpo.megatron.moe.local_dispatch import GroupedMoELayer
from megatron_grpo.ops.kernels import LayerKernels

try:
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:  # optional dependency
    HAVE_TE = False

define_te_general_gemm()  # megatron-core 0.16 without Transformer Engine (compat.py)


def _norm(kernels: LayerKernels) -> ModuleSpec:
    return ModuleSpec(module=Norm, params={"impl": kernels.elementwise})


def _context_parallel(config: TransformerConfig) -> tuple[object, int]:
    """(CP group, CP rank) the attention modules are given: (None, 0) without CP. Read here,
    where the model is built (megatron-core's parallel state is initialized by then)."""
    if config.context_parallel_size == 1:
        return None, 0
    return parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank()


def _expert_groups(groups=None) -> tuple | None:
    """(expert-TP, EP, expert-DP) groups for :class:`GroupedExperts` where megatron-core (0.14)
    hands the experts no process-group collection (None before the parallel state exists);
    ``groups``: a model's own collection (a generation replica's), read instead."""
    if groups is not None:
        return groups.expt_tp, groups.ep, groups.expt_dp
    ps = parallel_state
    if not ps.model_parallel_is_initialized():
        return None
    return (
        ps.get_expert_tensor_parallel_group(),
        ps.get_expert_model_parallel_group(),
        ps.get_expert_data_parallel_group(),
    )


def _attention_spec(config: TransformerConfig, kernels: LayerKernels) -> ModuleSpec:
    column, row = tp_linear_classes(kernels.tp_overlap, config)
    qk_norm = _norm(kernels) if config.qk_layernorm else IdentityOp
    cp_group, cp_rank = _context_parallel(config)
    core = ModuleSpec(
        module=SDPAttention,
        params={
            "buckets": kernels.attention,
            "packed": kernels.packed_attention,
            "cp_group": cp_group,
        },
    )
    return ModuleSpec(
        module=PackedRopeSelfAttention,
        params={
            "attn_mask_type": AttnMaskType.causal,
            "packed_rope": kernels.rope,
            "qk_norm_rope": kernels.qk_norm_rope,
            "cp_rank": cp_rank,
        },
        submodules=SelfAttentionSubmodules(
            linear_qkv=column,
            core_attention=core,
            linear_proj=row,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )


def portable_layer_spec(
    config: TransformerConfig, moe: bool, kernels: LayerKernels | None = None, groups=None
) -> ModuleSpec:
    """One decoder layer of the portable spec (dense MLP, or megatron-core MoE when ``moe``),
    its modules running ``kernels`` (default: ``LayerKernels()``, every choice "auto").
    ``groups``: the model's own ``ProcessGroupCollection`` (given to GPTModel too), handed to
    the MLP modules that megatron-core < 0.19 gives none (it passes one only to its own
    classes); None: the initialized parallel state's groups."""
    kernels = kernels or LayerKernels()
    if moe:
        mlp = get_moe_module_spec_for_backend(
            LocalSpecProvider(), num_experts=config.num_moe_experts, moe_grouped_gemm=False
        )
        if config.moe_grouped_gemm:  # SequentialMLP's drop-in: all local experts in 2 GEMMs
            mlp = _with_grouped_experts(mlp, kernels, groups)
        else:  # only GroupedMoELayer has these choices
            for name in ("moe_dispatch", "moe_sort"):
                if getattr(kernels, name) != "auto":
                    raise ValueError(
                        f"model.layer_kernels.{name}={getattr(kernels, name)!r} needs grouped "
                        "experts (model.moe_grouped_gemm: true)"
                    )
        # Same keys as the TE spec: only the attention norm is fused there for MoE layers.
        keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    else:
        column, row = tp_linear_classes(kernels.tp_overlap, config)
        mlp = ModuleSpec(
            module=SwiGLUMLP,
            params={"impl": kernels.elementwise, "default_groups": groups},
            submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row),
        )
        keys_map = {
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
        }
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=_norm(kernels),
            self_attention=_attention_spec(config, kernels),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=_norm(kernels),
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def _with_grouped_experts(mlp, kernels: LayerKernels, groups=None):
    """megatron-core's MoE layer spec as :class:`GroupedMoELayer` (the local dispatch where all
    experts are on the rank) with :class:`GroupedExperts` running ``kernels`` (its grouped GEMM
    and SwiGLU): a ``ModuleSpec`` (megatron-core <= 0.18) or ``partial(MoELayer, ...)`` (0.19)."""
    params = {"gemm_impl": kernels.grouped_gemm, "impl": kernels.elementwise}
    params["expert_groups"] = _expert_groups(groups)
    experts = ModuleSpec(module=GroupedExperts, params=params)
    dispatch = {"moe_dispatch": kernels.moe_dispatch, "moe_sort": kernels.moe_sort}
    dispatch["elementwise"] = kernels.elementwise
    dispatch["default_groups"] = groups
    if isinstance(mlp, ModuleSpec):
        mlp.module = GroupedMoELayer
        mlp.submodules.experts = experts
        mlp.params = {**(mlp.params or {}), **dispatch}
        return mlp
    submodules = dataclasses.replace(mlp.keywords["submodules"], experts=experts)
    return functools.partial(
        GroupedMoELayer, *mlp.args, **{**mlp.keywords, "submodules": submodules, **dispatch}
    )


def decoder_block_spec(
    config: TransformerConfig,
    use_te: bool,
    vp_stage: int | None = None,
    kernels: LayerKernels | None = None,
    groups=None,
) -> TransformerBlockSubmodules:
    """The layers of this pipeline (and virtual) stage plus the final norm.

    ``use_te``: Transformer Engine's spec (megatron-core's ``get_gpt_decoder_block_spec``);
    otherwise the portable spec of this module, its modules running ``kernels`` (default:
    ``LayerKernels()``). ``groups``: the model's own ``ProcessGroupCollection`` (portable spec
    only; None: the parallel state's).
    """
    kernels = kernels or LayerKernels()
    if use_te:
        if not HAVE_TE:
            raise ValueError("transformer_impl 'transformer_engine' but it does not import")
        tp_linear_classes(kernels.tp_overlap, config, use_te=True)  # only "auto" there
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    pattern = moe_layer_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    specs = {flag: portable_layer_spec(config, flag, kernels, groups) for flag in set(pattern)}
    return TransformerBlockSubmodules(
        layer_specs=[specs[flag] for flag in pattern[offset : offset + count]],
        layer_norm=_norm(kernels),
    )
