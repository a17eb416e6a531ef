"""Model and parallelism config sections, and their translation to Megatron's TransformerConfig.

Field names follow megatron-core's ``TransformerConfig`` / ``ModelParallelConfig`` so that a
Megatron user reads the YAML without a glossary. Load them with
:func:`megatron_grpo.config.from_dict` (unknown keys raise an error naming the closest key)::

    model = from_dict(ModelConfig, {"num_layers": 2, "hidden_size": 64, ...})
    parallel = from_dict(ParallelConfig, {"tensor_model_parallel_size": 2})
    check_parallel(model, parallel, world_size=4)
    tcfg = to_transformer_config(model, parallel)

Checks that need only one section live in ``__post_init__``; checks that need both (head counts
vs TP, experts vs EP, world size) live in :func:`check_parallel`, which :func:`build_model`
(``megatron_grpo.megatron.model.build``) calls. Both raise ``ValueError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from megatron_grpo.config import check_positive
from megatron_grpo.megatron.recompute_fields import check_recompute, check_resolved
from megatron_grpo.ops.kernels import LayerKernels

ParamsDtype = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
_DEFAULT_ROPE_SCALING_FACTOR = 8.0  # megatron-core GPTModel's default
# YarnRotaryEmbedding's defaults (and the YaRN paper's beta_fast / beta_slow).
_YARN_DEFAULTS = {
    "yarn_rotary_scaling_factor": None,
    "yarn_original_max_position_embeddings": None,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_mscale": 1.0,
    "yarn_mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": True,
}


@dataclass
class ModelConfig:
    """GPT architecture (dense or MoE); names are megatron-core TransformerConfig fields.

    ``vocab_size`` is the tokenizer's real vocabulary; the embedding/output layer is padded to
    a multiple of ``make_vocab_size_divisible_by * TP`` (see ``padded_vocab_size``) and padded
    ids are never sampled or scored. ``params_dtype="auto"`` means float32 on CPU and bfloat16
    on GPU. ``transformer_impl="auto"`` uses Transformer Engine's layer spec when
    ``transformer_engine`` imports, else our portable spec (``layer_spec.py``).
    ``moe_grouped_gemm=None`` runs the experts as grouped GEMMs (``grouped_experts.py``).
    ``moe_token_dispatcher_type=None`` picks "alltoall" on GPU and "allgather" on CPU (megatron's
    all-to-all dispatcher needs CUDA streams).
    ``rope_scaling`` is Llama 3.x RoPE scaling (GPTModel's ``rope_scaling``): inverse frequencies
    with wavelengths above 8192 are divided by ``rope_scaling_factor``, those between 2048 and
    8192 interpolated (megatron-core fixes low_freq_factor=1, high_freq_factor=4 and
    original_max_position_embeddings=8192).
    ``position_embedding_type="yarn"`` is YaRN (HF ``rope_type: yarn``, e.g. Qwen3 past 32k): the
    ``yarn_*`` fields are Megatron's names; cos/sin are scaled by the attention factor
    ``mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim)``, 0.1 ln(factor) + 1 by
    default.
    """

    vocab_size: int = 0
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    max_sequence_length: int = 2048
    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    layernorm_epsilon: float = 1e-5
    qk_layernorm: bool = False
    add_qkv_bias: bool = False
    add_bias_linear: bool = False
    gated_linear_unit: bool = True
    activation_func: Literal["silu", "gelu", "relu"] = "silu"
    position_embedding_type: Literal["rope", "yarn", "learned_absolute", "none"] = "rope"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    rope_scaling: bool = False
    rope_scaling_factor: float = _DEFAULT_ROPE_SCALING_FACTOR
    # YaRN (position_embedding_type="yarn" only).
    yarn_rotary_scaling_factor: float | None = None
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float = _YARN_DEFAULTS["yarn_beta_fast"]
    yarn_beta_slow: float = _YARN_DEFAULTS["yarn_beta_slow"]
    yarn_mscale: float = _YARN_DEFAULTS["yarn_mscale"]
    yarn_mscale_all_dim: float = _YARN_DEFAULTS["yarn_mscale_all_dim"]
    yarn_correction_range_round_to_int: bool = _YARN_DEFAULTS["yarn_correction_range_round_to_int"]
    share_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    params_dtype: ParamsDtype = "auto"
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    # MoE (megatron-core MoELayer); num_moe_experts=None means a dense model.
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int = 1
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False  # sigmoid(x . w) scales the shared experts (Qwen2-MoE)
    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "global_aux_loss", "none"
    ] = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_dtype: Literal["fp32", "fp64"] | None = "fp32"
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] | None = None
    # Grouped GEMMs over the local experts: Transformer Engine's TEGroupedMLP on its spec, the
    # portable spec's GroupedExperts (torch's grouped_mm) otherwise; None = on for MoE models.
    # False = megatron-core's SequentialMLP (a Python loop over the experts: the reference).
    moe_grouped_gemm: bool | None = None
    # Rollout Routing Replay (R3): replay the generator's top-k expert ids in the log-prob and
    # training forwards (megatron_grpo.megatron.moe.routing_replay; needs megatron-core >= 0.16).
    moe_enable_routing_replay: bool = False
    # Activation recomputation (TransformerConfig names; "auto": see recompute_fields.py).
    recompute_granularity: Literal["full", "selective", "auto"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None  # "selective" only; None = ["core_attn"]
    # The portable spec's layer kernels (element-wise, grouped GEMM, RoPE, attention buckets),
    # given to its modules when the model is built (not Megatron fields: TE's spec ignores them).
    layer_kernels: LayerKernels = field(default_factory=LayerKernels)

    def __post_init__(self) -> None:
        check_positive(self, "vocab_size", "num_layers", "hidden_size", "num_attention_heads")
        check_positive(self, "num_query_groups", "ffn_hidden_size", "kv_channels")
        check_positive(self, "max_sequence_length", "make_vocab_size_divisible_by")
        check_positive(self, "layernorm_epsilon", "init_method_std")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads="
                f"{self.num_attention_heads} (or set kv_channels)"
            )
        groups = self.num_query_groups
        if groups is not None and self.num_attention_heads % groups:
            raise ValueError(
                f"num_query_groups={groups} must divide num_attention_heads="
                f"{self.num_attention_heads}"
            )
        self._check_rope()
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        self._check_moe()
        check_recompute(self)

    def _check_rope(self) -> None:
        check_positive(self, "rotary_base", "rope_scaling_factor")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.rope_scaling and self.position_embedding_type != "rope":
            raise ValueError(
                f"rope_scaling needs position_embedding_type='rope', got "
                f"{self.position_embedding_type!r}"
            )
        # Megatron ignores the factor without rope_scaling: a set factor would be a silent no-op.
        if not self.rope_scaling and self.rope_scaling_factor != _DEFAULT_ROPE_SCALING_FACTOR:
            raise ValueError(
                f"rope_scaling_factor={self.rope_scaling_factor} has no effect unless "
                "rope_scaling is true"
            )
        self._check_yarn()

    def _check_yarn(self) -> None:
        if self.position_embedding_type != "yarn":
            # Megatron reads the yarn_* fields only for YaRN: a set one would be a silent no-op.
            changed = [k for k, v in _YARN_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)}: no effect with position_embedding_type="
                    f"{self.position_embedding_type!r} (YaRN needs 'yarn')"
                )
            return
        check_positive(self, "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings")
        check_positive(self, "yarn_beta_fast", "yarn_beta_slow")
        if (
            self.yarn_rotary_scaling_factor is None
            or not self.yarn_original_max_position_embeddings
        ):
            raise ValueError(
                "position_embedding_type='yarn' needs yarn_rotary_scaling_factor and "
                "yarn_original_max_position_embeddings"
            )
        if self.rotary_percent != 1.0 or self.rotary_interleaved or self.rope_scaling:
            raise ValueError(
                "YaRN (megatron-core's YarnRotaryEmbedding) rotates the whole head dimension, not "
                "interleaved, without llama3 rope_scaling: set rotary_percent=1.0, "
                "rotary_interleaved=false, rope_scaling=false"
            )

    def _check_moe(self) -> None:
        check_positive(self, "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size")
        check_positive(self, "moe_layer_freq", "moe_shared_expert_intermediate_size")
        if self.num_moe_experts is None:
            if (
                self.moe_aux_loss_coeff
                or self.moe_ffn_hidden_size
                or self.moe_grouped_gemm
                or self.moe_enable_routing_replay
            ):
                raise ValueError(
                    "moe_aux_loss_coeff / moe_ffn_hidden_size / moe_grouped_gemm / "
                    "moe_enable_routing_replay need num_moe_experts"
                )
            return
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size")
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} exceeds num_moe_experts="
                f"{self.num_moe_experts}"
            )
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def torch_dtype(self, device: torch.device | str | None = None) -> torch.dtype:
        """The parameter dtype; ``auto`` = float32 on CPU, bfloat16 on CUDA."""
        if self.params_dtype != "auto":
            return _DTYPES[self.params_dtype]
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# The sizes that shape the model's shards, by Megatron's names (those of ``TransformerConfig``
# and ``parallel_state.initialize_model_parallel``): the one list of them.
LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


@dataclass
class ParallelConfig:
    """Megatron parallel layout (ModelParallelConfig names) plus DDP gradient-reduction knobs.

    ``expert_tensor_parallel_size=None`` means Megatron's default (= tensor_model_parallel_size).
    World size = TP * CP * PP * DP, and must also be divisible by ETP * EP * PP
    (:attr:`expert_model_size`); the derived sizes are computed here and nowhere else.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False
    grad_reduce_in_fp32: bool = True
    overlap_grad_reduce: bool = False

    def __post_init__(self) -> None:
        check_positive(self, *LAYOUT_FIELDS)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1 and self.pipeline_model_parallel_size == 1:
            raise ValueError(
                "virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size > 1"
            )

    @property
    def model_parallel_size(self) -> int:
        """TP * PP * CP: the ranks of one model replica."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        return tp * pp * self.context_parallel_size

    @property
    def expert_tensor_size(self) -> int:
        """ETP: ``expert_tensor_parallel_size``, by default TP (Megatron's rule)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_model_size(self) -> int:
        """ETP * EP * PP: the ranks of one replica of the experts."""
        return (
            self.expert_tensor_size
            * self.expert_model_parallel_size
            * self.pipeline_model_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        """DP of ``world_size`` ranks."""
        return world_size // self.model_parallel_size

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Expert DP of ``world_size`` ranks: the replicas of each expert shard."""
        return world_size // self.expert_model_size

    def layout_sizes(self) -> dict[str, int | None]:
        """The :data:`LAYOUT_FIELDS` by name (Megatron's keyword arguments)."""
        return {name: getattr(self, name) for name in LAYOUT_FIELDS}


def _div(value: int, by: int, what: str, by_name: str) -> None:
    if value % by:
        raise ValueError(f"{by_name}={by} must divide {what}={value}")


def check_parallel(model: ModelConfig, parallel: ParallelConfig, world_size: int | None) -> None:
    """Cross-section checks (model vs parallel layout, world size); ValueError naming fields."""
    tp = parallel.tensor_model_parallel_size
    tp_name = "parallel.tensor_model_parallel_size"
    _div(model.num_attention_heads, tp, "model.num_attention_heads", tp_name)
    _div(model.num_query_groups or model.num_attention_heads, tp, "model.num_query_groups", tp_name)
    if model.ffn_hidden_size is not None:
        _div(model.ffn_hidden_size, tp, "model.ffn_hidden_size", tp_name)
    stages = parallel.pipeline_model_parallel_size * (
        parallel.virtual_pipeline_model_parallel_size or 1
    )
    _div(model.num_layers, stages, "model.num_layers", "pipeline stages (PP * VPP)")
    _check_expert_layout(model, parallel)
    if model.max_sequence_length % (2 * parallel.context_parallel_size) and (
        parallel.context_parallel_size > 1
    ):
        raise ValueError(
            "model.max_sequence_length must be divisible by 2 * parallel.context_parallel_size"
        )
    if world_size is not None:
        _check_world_size(parallel, world_size)


def _check_expert_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    ep = parallel.expert_model_parallel_size
    if model.num_moe_experts is None:
        if ep > 1:
            raise ValueError("parallel.expert_model_parallel_size > 1 needs model.num_moe_experts")
        return
    _div(model.num_moe_experts, ep, "model.num_moe_experts", "parallel.expert_model_parallel_size")
    if parallel.pipeline_model_parallel_size > 1 and dispatcher_type(model) == "allgather":
        raise ValueError(
            "model.moe_token_dispatcher_type 'allgather' (the CPU default) does not support the "
            "variable sequence lengths of pipeline parallelism; use 'alltoall' (needs CUDA)"
        )


def _check_world_size(parallel: ParallelConfig, world_size: int) -> None:
    if world_size % parallel.model_parallel_size:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor * pipeline * context parallel "
            f"sizes = {parallel.model_parallel_size}"
        )
    expert_mp = parallel.expert_model_size
    if world_size % expert_mp:
        raise ValueError(
            f"world size {world_size} is not divisible by expert_tensor * expert_model * "
            f"pipeline parallel sizes = {expert_mp}"
        )


def dispatcher_type(model: ModelConfig) -> str:
    """The MoE token dispatcher: the configured one, else alltoall on GPU, allgather on CPU."""
    if model.moe_token_dispatcher_type is not None:
        return model.moe_token_dispatcher_type
    return "alltoall" if torch.cuda.is_available() else "allgather"


def to_transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype | None = None,
    extra: Mapping[str, Any] | None = None,
):
    """Megatron ``TransformerConfig`` for this model and layout.

    Sets ``calculate_per_token_loss=True`` (the convention of ``forward.py``'s loss function),
    ``variable_seq_lengths=True`` under pipeline parallelism (packed micro-batches differ in
    length, so stages exchange shapes) and CPU initialization when no GPU is present.
    ``extra``: ``TransformerConfig`` fields by name, passed as-is after these (for fields this
    config does not cover).
    """
    from megatron.core.transformer import TransformerConfig

    check_resolved(model)
    dtype = params_dtype or model.torch_dtype()
    moe = model.num_moe_experts is not None
    kwargs: dict[str, Any] = dict(
        **_model_kwargs(model),
        **_parallel_kwargs(parallel),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        calculate_per_token_loss=True,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Off: these fusions need apex / TE / CUDA kernels that are optional here.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Megatron rejects variable_seq_lengths with the allgather dispatcher even for dense
        # models, where the dispatcher is unused.
        moe_token_dispatcher_type=dispatcher_type(model) if moe else "alltoall",
    )
    if moe:
        kwargs.update(_moe_kwargs(model))
    kwargs.update(extra or {})
    config = TransformerConfig(**kwargs)
    if model.position_embedding_type == "yarn":
        _attach_yarn(config, model)
    return config


def _model_kwargs(model: ModelConfig) -> dict[str, Any]:
    """TransformerConfig's architecture fields (same names as ModelConfig's)."""
    return dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.layernorm_epsilon,
        qk_layernorm=model.qk_layernorm,
        add_qkv_bias=model.add_qkv_bias,
        add_bias_linear=model.add_bias_linear,
        gated_linear_unit=model.gated_linear_unit,
        activation_func=_ACTIVATIONS[model.activation_func],
        rotary_interleaved=model.rotary_interleaved,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
        recompute_modules=model.recompute_modules and list(model.recompute_modules),  # a copy
    )


def _parallel_kwargs(parallel: ParallelConfig) -> dict[str, Any]:
    """TransformerConfig's layout fields (Megatron's names)."""
    return dict(
        **parallel.layout_sizes(),
        sequence_parallel=parallel.sequence_parallel,
        variable_seq_lengths=parallel.pipeline_model_parallel_size > 1,
    )


def _moe_kwargs(model: ModelConfig) -> dict[str, Any]:
    """TransformerConfig's MoE fields (same names as ModelConfig's)."""
    return dict(
        num_moe_experts=model.num_moe_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
        moe_layer_freq=model.moe_layer_freq,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=model.moe_shared_expert_gate,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_dtype=model.moe_router_dtype,
        moe_grouped_gemm=model.moe_grouped_gemm is not False,
    )


def _attach_yarn(config: Any, model: ModelConfig) -> None:
    """Set the ``yarn_*`` attributes GPTModel and attention read with ``getattr``.

    megatron-core declares them on ``MLATransformerConfig`` only, but its GPT path reads them from
    any config: ``YarnRotaryEmbedding`` in GPTModel, the attention factor in ``Attention``.
    """
    from megatron.core.transformer import attention

    if not hasattr(attention, "_yarn_get_concentration_factor_from_config"):
        raise ValueError(
            "position_embedding_type='yarn': this megatron-core does not apply YaRN's attention "
            "factor in GPT attention (its results would differ from Hugging Face); upgrade "
            "megatron-core"
        )
    for name in _YARN_DEFAULTS:
        setattr(config, name, getattr(model, name))
