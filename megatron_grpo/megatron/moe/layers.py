"""Which layers of a model are MoE: read by the layer spec, routing replay and the metrics."""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig


def moe_layer_pattern(config: TransformerConfig) -> list[bool]:
    """Which of the ``num_layers`` global layers are MoE (every ``moe_layer_freq``-th)."""
    if config.num_moe_experts is None:
        return [False] * config.num_layers
    return [i % config.moe_layer_freq == 0 for i in range(config.num_layers)]
