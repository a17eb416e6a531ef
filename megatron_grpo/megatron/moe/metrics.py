"""The MoE router's auxiliary losses as trainer metrics (``moe/load_balancing_loss``, ...).

megatron-core's routers add each layer's aux loss (divided by its coefficient) to a layer-wise
tracker on every training forward (no-grad passes add nothing). Here the tracker is turned into
one number per loss: the mean over MoE layers and over this step's training micro-batches,
reduced as Megatron's own ``track_moe_metrics`` does (summed over pipeline stages and the loss's
token-sharding group, averaged over data-parallel ranks), and then cleared.

Every rank must call it at the same point with the same config: the reduction is a collective,
so a loss that is enabled but has no entry on some rank (a stage without MoE layers) gets a zero
entry first.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_grpo.megatron.moe.layers import moe_layer_pattern
from megatron_grpo.megatron.parallel import comm_device

# Tracker names of megatron-core's routers, by the config field that enables them.
_AUX_LOSSES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def tracked_losses(config: TransformerConfig) -> list[str]:
    """The tracker names this config's routers write (empty for dense models)."""
    if not config.num_moe_experts:
        return []
    names = []
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    types = types if isinstance(types, list) else [types]
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(types)
    for kind, coeff in zip(types, coeffs, strict=True):
        if kind in _AUX_LOSSES and coeff and coeff > 0:
            names.append(_AUX_LOSSES[kind])
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def moe_loss_metrics(config: TransformerConfig, num_micro_batches: int) -> dict[str, float]:
    """``{"moe/<name>": mean per MoE layer and training micro-batch}``; clears the tracker.

    ``num_micro_batches``: this rank's training forwards since the last call (0: nothing to
    report, the tracker is still cleared).
    """
    names = tracked_losses(config)
    if not names:
        return {}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in names:
        if name not in tracker:
            tracker[name] = {"values": torch.zeros(config.num_layers, device=comm_device())}
        # Per micro-batch before the DP average: ranks may run different micro-batch counts.
        tracker[name]["values"].div_(max(num_micro_batches, 1))
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    layers = sum(moe_layer_pattern(config))
    out = {f"moe/{name}": float(tracker[name]["values"].sum()) / layers for name in names}
    moe_utils.clear_aux_losses_tracker()
    return out
