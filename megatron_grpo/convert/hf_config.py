"""HF ``config.json`` <-> :class:`~megatron_grpo.megatron.config.ModelConfig`.

HF configs are read through ``transformers.AutoConfig`` (it normalizes renamed keys across
versions, e.g. ``rope_theta`` -> ``rope_parameters``, ``num_experts`` <-> ``num_local_experts``).
Anything the Megatron model cannot express (rope scaling other than Llama 3's or YaRN, biases on the output
projection, MoE layer patterns other than "every layer", non-SiLU activations) is an error, never
dropped.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from pathlib import Path
from typing import Any

from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.families import Family, family_for_architecture
from megatron_grpo.megatron.config import ModelConfig

log = logging.getLogger(__name__)

YARN_FIELDS = (
    "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int",
)
# Families whose attention uses config.sliding_window whenever it is set.
_SLIDING_WINDOW = ("mistral", "mixtral")
# Fields that describe the architecture (compared when an exported config must agree with the
# checkpoint's model_config.yaml); the rest are training knobs.
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "normalization",
    "layernorm_epsilon",
    "qk_layernorm",
    "add_qkv_bias",
    "add_bias_linear",
    "gated_linear_unit",
    "activation_func",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "rope_scaling",
    "rope_scaling_factor",
    *YARN_FIELDS,
    "share_embeddings_and_output_weights",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
)
# HF llama3 rope_scaling keys that megatron-core does not take (GPTModel passes only the factor).
LLAMA3_FIXED_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_hf_config(hf_dir: str | Path) -> tuple[Any, Family]:
    """``(transformers config, family)`` of the checkpoint in ``hf_dir``."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path}: missing (not a Hugging Face checkpoint directory?)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from e
    family = family_for_architecture(raw.get("architectures"), raw.get("model_type"))
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except (ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{path}: transformers cannot parse it: {e}") from e
    return cfg, family


def _rope(cfg: Any) -> tuple[float, str, dict]:
    """``(rope_theta, rope_type, parameters)`` for transformers 4.x and 5.x configs."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    kind = params.get("rope_type", params.get("type", "default"))
    if theta is None:
        raise ConversionError("config.json: rope_theta is missing")
    return float(theta), kind, params


def megatron_llama3_constants() -> dict[str, float]:
    """The llama3 parameters megatron-core hard-codes: GPTModel hands RotaryEmbedding only the
    factor, so the others are the defaults of ``RotaryEmbedding._apply_scaling`` (read from the
    installed version rather than copied: 1, 4, 8192 in megatron-core 0.14-0.16)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    params = inspect.signature(RotaryEmbedding._apply_scaling).parameters
    missing = [k for k in LLAMA3_FIXED_KEYS if k not in params]
    if missing:
        raise ConversionError(f"this megatron-core's llama3 RoPE scaling has no {missing}")
    return {k: params[k].default for k in LLAMA3_FIXED_KEYS}


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's cos/sin scale from the ``yarn_*`` fields: megatron-core's own function (the one its
    attention applies), so the mapping follows the installed version."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor,
    )

    return _yarn_get_concentration_factor(factor, mscale, mscale_all_dim)


def _yarn_fields(cfg: Any, params: dict) -> dict[str, Any]:
    """ModelConfig YaRN fields of an HF ``rope_type: yarn`` (transformers' defaults applied)."""
    original = params.get("original_max_position_embeddings")
    _require(original is not None, "rope_scaling.original_max_position_embeddings is missing")
    factor = params.get("factor") or cfg.max_position_embeddings / original
    # transformers: the attention factor is mscale(factor, mscale) / mscale(factor,
    # mscale_all_dim) when both are set (and non-zero), else 0.1 ln(factor) + 1; megatron-core's
    # formula with mscale_all_dim=0 gives the latter.
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    m, m_all = (float(mscale), float(all_dim)) if mscale and all_dim else (1.0, 0.0)
    given = params.get("attention_factor")
    if given is not None:
        derived = yarn_attention_factor(float(factor), m, m_all)
        _require(
            math.isclose(float(given), derived, rel_tol=1e-9),
            f"rope_scaling.attention_factor={given} is unsupported: megatron-core derives "
            f"{derived} from factor / mscale / mscale_all_dim",
        )
    return dict(
        position_embedding_type="yarn",
        yarn_rotary_scaling_factor=float(factor),
        yarn_original_max_position_embeddings=int(original),
        yarn_beta_fast=float(params.get("beta_fast") or 32),
        yarn_beta_slow=float(params.get("beta_slow") or 1),
        yarn_mscale=m,
        yarn_mscale_all_dim=m_all,
        yarn_correction_range_round_to_int=bool(params.get("truncate", True)),
    )


def _rope_scaling_fields(cfg: Any, kind: str, params: dict) -> dict[str, Any]:
    """ModelConfig rope-scaling fields of an HF rope type; unsupported types are an error."""
    if kind == "default":
        return {}
    if kind == "yarn":
        return _yarn_fields(cfg, params)
    if kind != "llama3":
        raise ConversionError(
            f"config.json: rope scaling {kind!r} ({params}) is unsupported: megatron-core's "
            "GPTModel takes Llama 3 scaling (rope_type 'llama3') and YaRN ('yarn')"
        )
    for key, fixed in megatron_llama3_constants().items():
        value = params.get(key)
        _require(
            value is not None and float(value) == float(fixed),
            f"rope_scaling.{key}={value!r} is unsupported: megatron-core's llama3 RoPE scaling "
            f"hard-codes {key}={fixed}",
        )
    _require(params.get("factor") is not None, "rope_scaling.factor is missing (rope_type llama3)")
    return dict(rope_scaling=True, rope_scaling_factor=float(params["factor"]))


def hf_rope_scaling(model_cfg: ModelConfig) -> dict[str, Any] | None:
    """The HF ``rope_scaling`` dict of ``model_cfg`` (None without rope scaling)."""
    if model_cfg.position_embedding_type == "yarn":
        yarn = {
            "rope_type": "yarn",
            "factor": model_cfg.yarn_rotary_scaling_factor,
            "original_max_position_embeddings": model_cfg.yarn_original_max_position_embeddings,
            "beta_fast": model_cfg.yarn_beta_fast,
            "beta_slow": model_cfg.yarn_beta_slow,
            "truncate": model_cfg.yarn_correction_range_round_to_int,
        }
        if model_cfg.yarn_mscale_all_dim:  # else transformers' default factor is megatron's
            yarn.update(mscale=model_cfg.yarn_mscale, mscale_all_dim=model_cfg.yarn_mscale_all_dim)
        elif model_cfg.yarn_mscale != 1.0:
            yarn["attention_factor"] = yarn_attention_factor(
                model_cfg.yarn_rotary_scaling_factor, model_cfg.yarn_mscale, 0.0
            )
        return yarn
    if not model_cfg.rope_scaling:
        return None
    return {
        "rope_type": "llama3",
        "factor": model_cfg.rope_scaling_factor,
        **{k: float(v) for k, v in megatron_llama3_constants().items()},
    }


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConversionError(f"config.json: {message}")


def _check_supported(cfg: Any, family: Family) -> None:
    _require(
        getattr(cfg, "hidden_act", "silu") == "silu",
        f"hidden_act={cfg.hidden_act!r} unsupported (only gated SiLU MLPs)",
    )
    _require(
        not getattr(cfg, "mlp_bias", False),
        "mlp_bias=true is unsupported (no MLP bias in Megatron)",
    )
    _require(
        not getattr(cfg, "attention_bias", False),
        "attention_bias=true is unsupported (it also biases o_proj; Megatron biases only QKV)",
    )
    if family.moe:
        _require(
            getattr(cfg, "decoder_sparse_step", 1) == 1 and not getattr(cfg, "mlp_only_layers", []),
            "decoder_sparse_step != 1 / mlp_only_layers (dense layers inside an MoE model) are "
            "unsupported",
        )


def _max_sequence_length(cfg: Any, family: Family) -> int:
    """max_position_embeddings, capped at an active sliding window (see docs/conversion.md)."""
    length = cfg.max_position_embeddings
    window = getattr(cfg, "sliding_window", None)
    active = family.name in _SLIDING_WINDOW or getattr(cfg, "use_sliding_window", False)
    if active and window is not None and window < length:
        log.warning(
            "sliding_window=%d < max_position_embeddings=%d: Megatron uses full attention, which "
            "matches only up to the window; max_sequence_length is set to %d",
            window,
            length,
            window,
        )
        return window
    return length


def _moe_fields(cfg: Any, family: Family) -> dict[str, Any]:
    """ModelConfig MoE fields. HF routers: softmax over all experts, top-k, then renormalized iff
    ``norm_topk_prob`` (Mixtral: always). Megatron's ``moe_router_pre_softmax=False`` is top-k
    then softmax over the k, i.e. the renormalized probabilities."""
    if family.name == "mixtral":
        _require(
            not getattr(cfg, "router_jitter_noise", 0.0),
            f"router_jitter_noise={cfg.router_jitter_noise} is unsupported (set it to 0)",
        )
        return dict(
            num_moe_experts=cfg.num_local_experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.intermediate_size,
            moe_router_pre_softmax=False,
            moe_router_score_function="softmax",
        )
    fields = dict(
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_router_score_function="softmax",
    )
    if family.name == "qwen2_moe":
        fields.update(
            moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            moe_shared_expert_gate=True,
        )
    return fields


def _hf_moe_kwargs(model_cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """The HF config's MoE keys for ``model_cfg`` (what they cannot express fails the round
    trip check of :func:`hf_config_from_model`)."""
    if family.name == "mixtral":
        return dict(
            num_local_experts=model_cfg.num_moe_experts,
            num_experts_per_tok=model_cfg.moe_router_topk,
            intermediate_size=model_cfg.moe_ffn_hidden_size,
        )
    kwargs = dict(
        num_experts=model_cfg.num_moe_experts,
        num_experts_per_tok=model_cfg.moe_router_topk,
        moe_intermediate_size=model_cfg.moe_ffn_hidden_size,
        norm_topk_prob=not model_cfg.moe_router_pre_softmax,
    )
    if family.name == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = model_cfg.moe_shared_expert_intermediate_size
    return kwargs


def model_config_from_hf(cfg: Any, family: Family) -> ModelConfig:
    """The :class:`ModelConfig` of an HF config (training knobs keep ModelConfig defaults)."""
    _check_supported(cfg, family)
    theta, kind, params = _rope(cfg)
    _require(theta.is_integer(), f"rope_theta={theta} must be an integer for ModelConfig")
    heads = cfg.num_attention_heads
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=heads,
        num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
        ffn_hidden_size=cfg.intermediate_size,
        kv_channels=getattr(cfg, "head_dim", None) or None,
        max_sequence_length=_max_sequence_length(cfg, family),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.rms_norm_eps),
        qk_layernorm=family.qk_norm,
        add_qkv_bias=family.qkv_bias,
        gated_linear_unit=True,
        activation_func="silu",
        rotary_base=int(theta),
        # transformers 5 keeps partial_rotary_factor in rope_parameters, 4.x on the config.
        rotary_percent=float(
            params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        ),
        share_embeddings_and_output_weights=bool(cfg.tie_word_embeddings),
        **({"position_embedding_type": "rope"} | _rope_scaling_fields(cfg, kind, params)),
    )
    if family.moe:
        kwargs.update(_moe_fields(cfg, family))
    try:
        return ModelConfig(**kwargs)
    except ValueError as e:
        raise ConversionError(f"config.json is inconsistent: {e}") from e


def hf_config_from_model(model_cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """An HF ``config.json`` dict for ``model_cfg`` (used when the checkpoint has none)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family.name]  # family names are transformers model_types
    kwargs: dict[str, Any] = dict(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size or 4 * model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_query_groups or model_cfg.num_attention_heads,
        head_dim=model_cfg.head_dim,
        max_position_embeddings=model_cfg.max_sequence_length,
        rms_norm_eps=model_cfg.layernorm_epsilon,
        tie_word_embeddings=model_cfg.share_embeddings_and_output_weights,
        hidden_act="silu",
        architectures=[family.architectures[0]],
    )
    if family.name in _SLIDING_WINDOW:
        kwargs["sliding_window"] = None
    if family.moe:
        kwargs.update(_hf_moe_kwargs(model_cfg, family))
    if model_cfg.rotary_percent != 1.0:
        kwargs["partial_rotary_factor"] = model_cfg.rotary_percent
    # rope_theta= and rope_scaling= are accepted by transformers 4.x and 5.x (5.x stores both in
    # rope_parameters).
    hf_cfg = cls(
        rope_theta=float(model_cfg.rotary_base), rope_scaling=hf_rope_scaling(model_cfg), **kwargs
    )
    # Whatever the HF config cannot express (LayerNorm, interleaved rotary, ...) fails here.
    try:
        check_same_architecture(model_cfg, model_config_from_hf(hf_cfg, family), "config.json")
    except ConversionError as e:
        raise ConversionError(
            f"an HF {family.name} config.json cannot express this model ({e})"
        ) from e
    return hf_cfg.to_dict()


def _effective(cfg: ModelConfig, name: str) -> Any:
    """A field's value with Megatron's defaults for None resolved (None = derived)."""
    if name == "kv_channels":
        return cfg.head_dim
    if name == "num_query_groups":
        return cfg.num_query_groups or cfg.num_attention_heads
    if name == "ffn_hidden_size":
        return cfg.ffn_hidden_size or 4 * cfg.hidden_size
    return getattr(cfg, name)


def check_same_architecture(a: ModelConfig, b: ModelConfig, what: str) -> None:
    """Raise if two model configs disagree on an architecture field."""
    for name in ARCHITECTURE_FIELDS:
        va, vb = _effective(a, name), _effective(b, name)
        if va != vb:
            raise ConversionError(f"{what}: {name} is {vb!r}, but the checkpoint has {va!r}")
