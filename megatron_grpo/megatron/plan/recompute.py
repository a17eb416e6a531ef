"""``model.recompute_granularity: auto``: the one place the activation-recompute setting is
chosen, from the memory plan.

The candidates (:data:`LADDER`), from the least recompute to the most: none; selective
``mlp`` (re-runs the dense MLP: ~2/3 of a layer's forward GEMMs); selective ``mlp, core_attn``
(re-runs attention too); full (uniform, 1 layer: re-runs every layer's forward). "layernorm"
is not a candidate: megatron-core runs it through ``CheckpointWithoutOutput``, which needs
Transformer Engine (recompute_fields.py), and TE's spec fuses the norms (nothing to drop). The choice is the first
whose per-rank peak (:func:`~megatron_grpo.megatron.plan.memory.memory_plan`, every stage)
fits the budget: ``1 - HEADROOM`` of the device's memory (the plan leaves out the CUDA context,
NCCL buffers and allocator fragmentation). A selective candidate that saves nothing over the
one before it (e.g. "mlp" on a model of MoE layers only) is skipped. When nothing fits, full
recompute (the smallest) is chosen and the reason says it does not fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_grpo.megatron.config import ModelConfig, ParallelConfig

GIB = 2**30
HEADROOM = 0.15  # of the device's memory, outside the plan (docs/scale.md: keep 10-15% free)
# (recompute_granularity, recompute_modules, recompute_method, recompute_num_layers)
LADDER: tuple[tuple[str | None, tuple[str, ...] | None, str | None, int | None], ...] = (
    (None, None, None, None),
    ("selective", ("mlp",), None, None),
    ("selective", ("mlp", "core_attn"), None, None),
    ("full", None, "uniform", 1),
)


@dataclass(frozen=True)
class RecomputeChoice:
    """``model``: the model config with the concrete setting; ``label`` names it; ``reason``:
    why (one line; "" when the setting was explicit); ``peaks``: (label, per-rank peak bytes)
    of each candidate looked at, in order; ``budget``: the bytes the peak had to fit."""

    model: ModelConfig
    label: str
    reason: str
    peaks: tuple[tuple[str, float], ...] = ()
    budget: float = 0.0


def recompute_label(cfg: ModelConfig) -> str:
    """``none``, ``selective [a, b]`` or ``full (uniform, 1 layer)``."""
    g = cfg.recompute_granularity
    if g is None:
        return "none"
    if g == "selective":
        return f"selective [{', '.join(cfg.recompute_modules or ('core_attn',))}]"
    if g == "full":
        n = cfg.recompute_num_layers
        return f"full ({cfg.recompute_method}, {n} layer{'s' if n != 1 else ''})"
    return str(g)


def _candidate(model: ModelConfig, step: tuple) -> ModelConfig:
    gran, mods, method, n = step
    return dataclasses.replace(
        model,
        recompute_granularity=gran,
        recompute_modules=None if mods is None else list(mods),
        recompute_method=method,
        recompute_num_layers=n,
    )


def choose_recompute(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    device_bytes: float | None,
    **plan_kwargs,
) -> RecomputeChoice:
    """The recompute setting to build ``model`` with under ``parallel``.

    Anything but ``recompute_granularity="auto"`` is returned as it is (reason ""). For
    "auto": the first :data:`LADDER` candidate whose plan peak fits ``(1 - HEADROOM) *
    device_bytes`` (module docstring); ``plan_kwargs``: :func:`memory_plan`'s other arguments
    (``micro_batch_tokens``, ``dp_size``, ``use_distributed_optimizer``, ...).
    ``device_bytes`` None with "auto": ValueError naming the field."""
    from megatron_grpo.megatron.plan.memory import memory_plan

    if model.recompute_granularity != "auto":
        return RecomputeChoice(model, recompute_label(model), "")
    if device_bytes is None or device_bytes <= 0:
        raise ValueError(
            "model.recompute_granularity='auto' sizes activations against the GPU's memory: "
            "no GPU here (the dry run takes --device-memory-gib; or set "
            "model.recompute_granularity to none, selective or full)"
        )
    budget = (1 - HEADROOM) * device_bytes
    peaks: list[tuple[str, float]] = []
    chosen = None
    for step in LADDER:
        cfg = _candidate(model, step)
        peak = memory_plan(cfg, parallel, **plan_kwargs).peak_bytes
        if step[0] == "selective" and peaks and peak >= peaks[-1][1]:
            continue  # recomputes more, saves nothing
        peaks.append((recompute_label(cfg), peak))
        chosen = cfg
        if peak <= budget:
            break
    assert chosen is not None
    label, peak = peaks[-1]
    room = f"{budget / GIB:.1f} GiB ({1 - HEADROOM:.2f} x {device_bytes / GIB:.1f} GiB device)"
    if peak <= budget:
        why = f"the least recompute whose per-rank peak ({peak / GIB:.1f} GiB) fits {room}"
    else:
        why = f"nothing fits {room}; it has the smallest peak ({peak / GIB:.1f} GiB)"
    listed = ", ".join(f"{name} {b / GIB:.1f}" for name, b in peaks)
    reason = f"model.recompute_granularity=auto -> {label}: {why}; peaks (GiB): {listed}"
    return RecomputeChoice(chosen, label, reason, tuple(peaks), budget)
