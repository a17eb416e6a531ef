"""Declarative HF <-> Megatron name maps, one per model family.

A :class:`Rule` pairs Megatron parameter-name templates (the names of the GPTModel that
``megatron_grpo.megatron.model.build`` builds; alternatives cover the portable and the Transformer
Engine layer specs, and the SequentialMLP / TEGroupedMLP expert layouts) with the HF tensor
names it is made of and the layout :class:`~megatron_grpo.convert.transforms.Transform`
between them. Templates hold ``{layer}`` and ``{expert}`` placeholders; nothing else is
hand-written per tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.transforms import GATE_UP, IDENTITY, QKV, VOCAB, Transform

_PLACEHOLDER = re.compile(r"\\\{(layer|expert)\\\}")


def _compile(template: str) -> re.Pattern[str]:
    return re.compile(_PLACEHOLDER.sub(r"(?P<\1>\\d+)", re.escape(template)) + r"\Z")


@dataclass(frozen=True)
class Rule:
    """Megatron parameter ``mcore`` (any of the alternative templates) <- HF tensors ``hf``."""

    mcore: tuple[str, ...]
    hf: tuple[str, ...]
    transform: Transform = IDENTITY
    patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.hf) != self.transform.num_hf:
            raise ValueError(f"rule {self.mcore[0]}: {self.transform.name} takes {len(self.hf)}")
        object.__setattr__(self, "patterns", tuple(_compile(t) for t in self.mcore))

    def match(self, name: str) -> dict[str, str] | None:
        """Placeholder values if ``name`` is one of this rule's Megatron names, else None."""
        for pattern in self.patterns:
            m = pattern.match(name)
            if m:
                return m.groupdict()
        return None

    def hf_names(self, fields: dict[str, str]) -> list[str]:
        return [t.format(**fields) for t in self.hf]


@dataclass(frozen=True)
class Family:
    """One HF architecture family: its name map and the HF names that carry no weights."""

    name: str
    architectures: tuple[str, ...]
    rules: tuple[Rule, ...]
    moe: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hf_ignored: tuple[str, ...] = (r".*\.rotary_emb\.inv_freq",)

    def rule_for(self, mcore_name: str) -> tuple[Rule, dict[str, str]]:
        """The rule mapping Megatron parameter ``mcore_name``, with its placeholder values."""
        for rule in self.rules:
            fields = rule.match(mcore_name)
            if fields is not None:
                return rule, fields
        raise ConversionError(
            f"family {self.name}: no HF tensor maps to Megatron parameter '{mcore_name}' "
            "(the model config enables a feature this family's name map does not cover)"
        )

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.hf_ignored)


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

_COMMON = (
    Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), VOCAB),
    Rule(("output_layer.weight",), ("lm_head.weight",), VOCAB),
    Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",)),
    Rule(
        (_L + "input_layernorm.weight", _L + "self_attention.linear_qkv.layer_norm_weight"),
        (_H + "input_layernorm.weight",),
    ),
    Rule(
        (_L + "self_attention.linear_qkv.weight",),
        tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"),
        QKV,
    ),
    Rule((_L + "self_attention.linear_proj.weight",), (_H + "self_attn.o_proj.weight",)),
)
_QKV_BIAS = (
    Rule(
        (_L + "self_attention.linear_qkv.bias",),
        tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"),
        QKV,
    ),
)
_QK_NORM = (
    Rule((_L + "self_attention.q_layernorm.weight",), (_H + "self_attn.q_norm.weight",)),
    Rule((_L + "self_attention.k_layernorm.weight",), (_H + "self_attn.k_norm.weight",)),
)
_DENSE_MLP = (
    Rule(
        (_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"),
        (_H + "post_attention_layernorm.weight",),
    ),
    Rule(
        (_L + "mlp.linear_fc1.weight",),
        (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
        GATE_UP,
    ),
    Rule((_L + "mlp.linear_fc2.weight",), (_H + "mlp.down_proj.weight",)),
)


def _moe_mlp(router: str, expert: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Router + routed experts; HF names relative to the layer (``router``) and to each expert
    (``expert`` holds ``{expert}``). SequentialMLP names its experts
    local_experts.<e>.linear_fc*; TEGroupedMLP linear_fc*.weight<e>."""
    e = _H + expert
    return (
        Rule((_L + "pre_mlp_layernorm.weight",), (_H + "post_attention_layernorm.weight",)),
        Rule((_L + "mlp.router.weight",), (_H + router,)),
        Rule(
            (
                _L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
                _L + "mlp.experts.linear_fc1.weight{expert}",
            ),
            (e + gate, e + up),
            GATE_UP,
        ),
        Rule(
            (
                _L + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
                _L + "mlp.experts.linear_fc2.weight{expert}",
            ),
            (e + down,),
        ),
    )


_MOE_MLP = _moe_mlp(
    "mlp.gate.weight",
    "mlp.experts.{expert}.",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)
_MIXTRAL_MLP = _moe_mlp(
    "block_sparse_moe.gate.weight",
    "block_sparse_moe.experts.{expert}.",
    "w1.weight",
    "w3.weight",
    "w2.weight",
)
# Qwen2-MoE's always-on shared expert, scaled by sigmoid(shared_expert_gate(x)).
_SHARED_EXPERT = (
    Rule(
        (_L + "mlp.shared_experts.linear_fc1.weight",),
        (_H + "mlp.shared_expert.gate_proj.weight", _H + "mlp.shared_expert.up_proj.weight"),
        GATE_UP,
    ),
    Rule(
        (_L + "mlp.shared_experts.linear_fc2.weight",), (_H + "mlp.shared_expert.down_proj.weight",)
    ),
    Rule((_L + "mlp.shared_experts.gate_weight",), (_H + "mlp.shared_expert_gate.weight",)),
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", ("LlamaForCausalLM",), _COMMON + _DENSE_MLP),
        Family("mistral", ("MistralForCausalLM",), _COMMON + _DENSE_MLP),
        Family("qwen2", ("Qwen2ForCausalLM",), _COMMON + _QKV_BIAS + _DENSE_MLP, qkv_bias=True),
        Family("qwen3", ("Qwen3ForCausalLM",), _COMMON + _QK_NORM + _DENSE_MLP, qk_norm=True),
        Family(
            "qwen3_moe",
            ("Qwen3MoeForCausalLM",),
            _COMMON + _QK_NORM + _MOE_MLP,
            moe=True,
            qk_norm=True,
        ),
        Family(
            "qwen2_moe",
            ("Qwen2MoeForCausalLM",),
            _COMMON + _QKV_BIAS + _MOE_MLP + _SHARED_EXPERT,
            moe=True,
            qkv_bias=True,
        ),
        Family("mixtral", ("MixtralForCausalLM",), _COMMON + _MIXTRAL_MLP, moe=True),
    )
}


def family_for_architecture(architectures: list[str] | None, model_type: str | None) -> Family:
    """The family of an HF config (``architectures`` first, then ``model_type``)."""
    for arch in architectures or []:
        for family in FAMILIES.values():
            if arch in family.architectures:
                return family
    if not architectures and model_type in FAMILIES:
        return FAMILIES[model_type]
    supported = sorted(a for f in FAMILIES.values() for a in f.architectures)
    raise ConversionError(
        f"unsupported architecture {architectures or model_type!r}; supported: "
        f"{', '.join(supported)}"
    )
