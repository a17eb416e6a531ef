"""Activation bytes of a pipeline stage: what each decoder layer saves for backward, and what
megatron-core's activation recompute leaves of it (``recompute_granularity`` "full" /
"selective" with ``recompute_modules``).

Per layer and token (:class:`LayerActivations`), bf16 unless said, with flash/SDPA attention:

* ``kept`` (saved whatever the selective modules): both norms' inputs, q/k before their norms,
  q/k/v as core attention takes them, the attention output (= projection input), MoE router
  logits (fp32), shared experts, permuted expert inputs / intermediates;
* ``layernorm``: the two norm outputs (= QKV and MLP / router inputs). "layernorm" runs the norms
  under megatron-core's ``CheckpointWithoutOutput``: the outputs are dropped after their GEMMs
  and recomputed in backward (the portable spec's separate ``Norm`` modules; Transformer
  Engine's spec fuses the norm into the GEMM, so there is nothing to drop there; and
  ``CheckpointWithoutOutput`` needs TE: without it the model build refuses "layernorm");
* ``core_attn``: what core attention saves beyond its inputs and output: the fp32 logsumexp
  (flash / cuDNN / memory-efficient kernels). Checkpointing core attention keeps its q/k/v
  inputs, and the output stays saved as the projection's input, so "core_attn" frees only this
  with flash attention (megatron-core says as much); it pays off with the math backend's
  [s, s] scores, which these plans do not assume;
* ``mlp`` (dense layers): the fc1 output and the activation output (= fc2 input); "mlp"
  checkpoints the whole MLP (its input stays saved: the pre-MLP norm output, ``layernorm``).

Recomputed modules run again in backward one layer at a time: their bytes of one layer are
counted once on top (the "working" set), as full recompute counts one recomputed unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_grpo.megatron.config import ModelConfig, ParallelConfig
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.model.layer_spec import HAVE_TE
from megatron_grpo.megatron.plan.params import _ffn, is_moe_layer, stage_layers
from megatron_grpo.megatron.recompute_fields import check_resolved, selective_modules

_LSE_BYTES = 4  # flash attention's fp32 logsumexp, per head and token


@dataclass(frozen=True)
class LayerActivations:
    """Saved-for-backward bytes of one layer, split by the recompute module that drops them
    (module docstring); ``attn_work``: what a core-attention recompute rebuilds (rotated q/k,
    output, logsumexp)."""

    kept: float
    layernorm: float
    core_attn: float
    mlp: float
    attn_work: float

    @property
    def total(self) -> float:
        return self.kept + self.layernorm + self.core_attn + self.mlp

    def saved(self, modules: tuple[str, ...]) -> float:
        """Bytes left saved with ``modules`` recomputed."""
        return self.total - sum(getattr(self, m) for m in _ESTIMATED if m in modules)

    def working(self, modules: tuple[str, ...]) -> float:
        """Bytes the recompute of ``modules`` rebuilds in this layer's backward."""
        work = {"layernorm": self.layernorm, "core_attn": self.attn_work, "mlp": self.mlp}
        return sum(work[m] for m in _ESTIMATED if m in modules)


# The modules whose savings the plan counts; the others (moe, moe_act, shared_experts,
# mla_up_proj) are counted as saving nothing (an upper bound).
_ESTIMATED = ("layernorm", "core_attn", "mlp")


def fused_norms(cfg: ModelConfig) -> bool:
    """Whether the layers' norms are fused into their GEMMs (Transformer Engine's spec)."""
    impl = cfg.transformer_impl
    return impl == "transformer_engine" or (impl == "auto" and HAVE_TE)


def layer_activations(
    cfg: ModelConfig, par: ParallelConfig, moe: bool, tokens: float, act_bytes: int
) -> LayerActivations:
    """Saved-for-backward bytes of one layer for ``tokens`` tokens on this CP rank, by module."""
    tp = par.tensor_model_parallel_size
    sp = ParallelLayout.of_config(par).token_multiple  # SP splits these activations over TP
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    # Attention: norm input | q, k, v, attention output (= projection input); pre-MLP norm input.
    sp_terms, tp_terms = 2 * h, (nq + 2 * nkv) * d + nq * d
    tp_terms += (nq + nkv) * d if cfg.qk_layernorm else 0  # q/k before their norms
    glu = 2 if cfg.gated_linear_unit else 1
    extra = mlp = 0.0
    if not moe:
        mlp = tokens * (glu + 1) * _ffn(cfg) / tp * act_bytes  # fc1 output, fc2 input
    else:
        experts = cfg.num_moe_experts or 0
        sp_terms += 4 * experts / act_bytes  # fp32 router logits
        shared = cfg.moe_shared_expert_intermediate_size or 0
        tp_terms += (glu + 1) * shared
        etp = par.expert_tensor_size
        copies = tokens / tp * cfg.moe_router_topk * etp  # tokens enter MoE SP-split (TP>1: SP)
        f_moe = cfg.moe_ffn_hidden_size or _ffn(cfg)
        extra = copies * (2 * h + (glu + 1) * f_moe / etp) * act_bytes  # permuted in/out
    norms_out = tokens * 2 * h / sp * act_bytes  # QKV input, MLP / router input
    kept = tokens * (sp_terms / sp + tp_terms / tp) * act_bytes + extra
    if fused_norms(cfg):  # LayerNormLinear: the GEMM saves the norm's input, not its output
        kept, norms_out = kept + norms_out, 0.0
    lse = tokens * nq / tp * _LSE_BYTES
    attn_work = lse + tokens * (2 * nq + nkv) * d / tp * act_bytes  # rotated q, k; output
    return LayerActivations(kept, norms_out, lse, mlp, attn_work)


def layer_activation_bytes(
    cfg: ModelConfig, par: ParallelConfig, moe: bool, tokens: float, act_bytes: int
) -> float:
    """Saved-for-backward bytes of one layer for ``tokens`` tokens on this CP rank (no
    recompute)."""
    return layer_activations(cfg, par, moe, tokens, act_bytes).total


def in_flight_micro_batches(par: ParallelConfig, stage: int) -> float:
    """Micro-batches whose activations a stage holds at once (in units of its full layers)."""
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    if not vpp or vpp == 1:
        return float(pp - stage)
    chunks = (pp - stage - 1) * 2 + (vpp - 1) * pp + 1  # Megatron's interleaved warm-up + 1
    return chunks / vpp


def stage_activation_bytes(
    cfg: ModelConfig, par: ParallelConfig, stage: int, tokens: float, act_bytes: int
) -> tuple[float, float]:
    """(activation bytes of the in-flight micro-batches, in-flight count) of one stage under
    the model's recompute setting (a resolved one: not "auto")."""
    check_resolved(cfg)
    layers = [
        layer_activations(cfg, par, is_moe_layer(cfg, i), tokens, act_bytes)
        for i in stage_layers(cfg, par, stage)
    ]
    flight = in_flight_micro_batches(par, stage)
    if not layers or cfg.recompute_granularity is None:
        return flight * sum(x.total for x in layers), flight
    if cfg.recompute_granularity == "selective":
        mods = selective_modules(cfg)
        stored = sum(x.saved(mods) for x in layers)
        return flight * stored + max(x.working(mods) for x in layers), flight
    full = [x.total for x in layers]
    sp = ParallelLayout.of_config(par).token_multiple
    layer_input = tokens / sp * cfg.hidden_size * act_bytes
    n = cfg.recompute_num_layers or 1
    if cfg.recompute_method == "block":
        n = min(n, len(full))
        stored = n * layer_input + sum(full[n:])
        return flight * stored + max(full[:n], default=0.0), flight
    groups = math.ceil(len(full) / n)
    working = max(sum(full[i : i + n]) for i in range(0, len(full), n))
    return flight * groups * layer_input + working, flight
