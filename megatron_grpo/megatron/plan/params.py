"""Exact per-rank parameter counts of the models ``build_model`` builds (the tests compare them
with ``numel``): per decoder layer, per pipeline stage (embedding, final norm, output layer)."""

from __future__ import annotations

from megatron_grpo.megatron.config import ModelConfig, ParallelConfig
from megatron_grpo.megatron.model.build import padded_vocab_size


def _norm(cfg: ModelConfig, size: int) -> int:
    return size * (2 if cfg.normalization == "LayerNorm" else 1)


def _ffn(cfg: ModelConfig) -> int:
    return cfg.ffn_hidden_size or 4 * cfg.hidden_size  # TransformerConfig's default


def _mlp_params(cfg: ModelConfig, ffn: int, shard: int) -> int:
    """fc1 ([2F or F] x H, column-parallel) + fc2 (H x F, row-parallel; bias not sharded)."""
    h, fc1 = cfg.hidden_size, ffn * (2 if cfg.gated_linear_unit else 1)
    n = fc1 // shard * h + h * (ffn // shard)
    return n + (fc1 // shard + h if cfg.add_bias_linear else 0)


def _attention_params(cfg: ModelConfig, tp: int) -> int:
    """input norm + QKV (column-parallel) + q/k norms + output projection (row-parallel)."""
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    qkv = (nq + 2 * nkv) * d // tp
    n = _norm(cfg, h) + qkv * h + h * (nq * d // tp)
    n += qkv if (cfg.add_qkv_bias or cfg.add_bias_linear) else 0
    n += h if cfg.add_bias_linear else 0
    return n + (2 * _norm(cfg, d) if cfg.qk_layernorm else 0)


def layer_params(cfg: ModelConfig, par: ParallelConfig, moe: bool) -> tuple[int, int]:
    """(non-expert, expert) parameters of one decoder layer on one rank."""
    tp = par.tensor_model_parallel_size
    dense = _attention_params(cfg, tp) + _norm(cfg, cfg.hidden_size)
    if not moe:
        return dense + _mlp_params(cfg, _ffn(cfg), tp), 0
    experts = cfg.num_moe_experts or 0
    dense += experts * cfg.hidden_size + (experts if cfg.add_bias_linear else 0)  # router
    if cfg.moe_shared_expert_intermediate_size:
        dense += _mlp_params(cfg, cfg.moe_shared_expert_intermediate_size, tp)
        dense += cfg.hidden_size if cfg.moe_shared_expert_gate else 0  # [1, H], replicated
    etp = par.expert_tensor_size
    local = experts // par.expert_model_parallel_size
    return dense, local * _mlp_params(cfg, cfg.moe_ffn_hidden_size or _ffn(cfg), etp)


def stage_layers(cfg: ModelConfig, par: ParallelConfig, stage: int) -> list[int]:
    """Global indices of the decoder layers held by pipeline rank ``stage`` (all its chunks)."""
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    per_chunk = cfg.num_layers // (pp * vpp)
    out = []
    for chunk in range(vpp):
        start = (chunk * pp + stage) * per_chunk
        out += range(start, start + per_chunk)
    return out


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    return cfg.num_moe_experts is not None and index % cfg.moe_layer_freq == 0


def stage_params(cfg: ModelConfig, par: ParallelConfig, stage: int) -> tuple[int, int]:
    """(non-expert, expert) parameters of one rank of pipeline stage ``stage`` (exact)."""
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dense = expert = 0
    for i in stage_layers(cfg, par, stage):
        d, e = layer_params(cfg, par, is_moe_layer(cfg, i))
        dense, expert = dense + d, expert + e
    vocab_rows = padded_vocab_size(cfg, tp) // tp * cfg.hidden_size
    if stage == 0:
        dense += vocab_rows
        if cfg.position_embedding_type == "learned_absolute":
            dense += cfg.max_sequence_length * cfg.hidden_size
    if stage == pp - 1:
        dense += _norm(cfg, cfg.hidden_size)  # final norm
        # Tied weights: one copy when first == last stage, else the last stage keeps its own.
        if not (cfg.share_embeddings_and_output_weights and pp == 1):
            dense += vocab_rows
    return dense, expert
