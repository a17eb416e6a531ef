"""Checks of ``ModelConfig``'s activation-recompute fields (megatron-core's names).

``recompute_granularity``: None (save every activation), "selective" (megatron-core checkpoints
the ``recompute_modules``), "full" (whole layers, ``recompute_method`` / ``recompute_num_layers``)
or "auto": the memory plan picks one of those (:mod:`megatron_grpo.megatron.plan.recompute`)
before the model is built. ``recompute_modules`` are megatron-core's module names (0.14-0.19).
"""

from __future__ import annotations

import difflib
import importlib.util
from typing import Any

# megatron-core's recompute_modules choices ("shared_experts": megatron-core >= 0.15).
RECOMPUTE_MODULES = (
    "core_attn",
    "mlp",
    "layernorm",
    "moe_act",
    "moe",
    "shared_experts",
    "mla_up_proj",
)
MEGATRON_DEFAULT_MODULES = ("core_attn",)  # TransformerConfig's default for "selective"
# Run through megatron-core's CheckpointWithoutOutput, whose fp8 default (``fp8 is not None``)
# takes a Transformer Engine-only branch: a NameError without TE (0.14-0.19).
NEED_TE = ("layernorm", "moe_act")


def check_recompute(cfg: Any) -> None:
    """ValueError naming the field for an inconsistent recompute setting of ``cfg`` (a
    ``ModelConfig``)."""
    gran, method, modules = cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_modules
    if (method is None) != (cfg.recompute_num_layers is None):
        raise ValueError("recompute_method and recompute_num_layers must be set together")
    if method is not None and gran != "full":
        raise ValueError("recompute_method needs recompute_granularity='full'")
    if gran == "full" and method is None:
        raise ValueError(
            "recompute_granularity='full' needs recompute_method (uniform | block) and "
            "recompute_num_layers"
        )
    if modules is None:
        return
    if gran != "selective":
        raise ValueError(
            f"recompute_modules={modules} needs recompute_granularity='selective' (got "
            f"{gran!r}; with 'auto' the memory plan chooses the modules)"
        )
    for name in modules:
        if name not in RECOMPUTE_MODULES:
            near = difflib.get_close_matches(name, RECOMPUTE_MODULES, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(
                f"recompute_modules: unknown module {name!r}{hint}; megatron-core's names are "
                f"{', '.join(RECOMPUTE_MODULES)}"
            )
    if len(set(modules)) != len(modules):
        raise ValueError(f"recompute_modules={modules} names a module twice")


def check_resolved(cfg: Any) -> None:
    """A model is built with a concrete setting: "auto" is resolved by the memory plan first."""
    if cfg.recompute_granularity == "auto":
        raise ValueError(
            "model.recompute_granularity='auto' is resolved by the memory plan before the model "
            "is built (megatron_grpo.megatron.plan.recompute.choose_recompute)"
        )
    if cfg.recompute_granularity != "selective" or importlib.util.find_spec("transformer_engine"):
        return
    need = [m for m in selective_modules(cfg) if m in NEED_TE]
    if need:
        raise ValueError(
            f"model.recompute_modules {need}: megatron-core recomputes these with "
            "CheckpointWithoutOutput, which needs Transformer Engine (not importable here); "
            "use mlp / core_attn, or full recompute"
        )


def selective_modules(cfg: Any) -> tuple[str, ...]:
    """The modules a "selective" ``cfg`` recomputes (None = megatron-core's default)."""
    mods = cfg.recompute_modules
    return tuple(MEGATRON_DEFAULT_MODULES if mods is None else mods)
