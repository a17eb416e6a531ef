"""The dry run's memory plan for ``bash tools/gpu_e2e.sh full8`` (tools/gpu_full8.sh), on any
machine (no GPU, no torch.distributed): the planned per-rank peak of a recipe plus ``--set``
overrides at a world size, and the most decoder layers that fit a GPU.

``--fit-layers``: the largest ``model.num_layers`` (a multiple of the pipeline stages PP x VPP,
at most the recipe's) whose planned peak fits ``(1 - HEADROOM)`` of ``--device-memory-gib``
(the budget ``recompute_granularity: auto`` plans with, ``megatron/plan/recompute.py``: the plan
leaves out the CUDA context, NCCL buffers, fragmentation and the rollout engine's KV cache).
The peak grows with the layer count, so a bisection over the multiples. Prints the count alone
on stdout (the shell reads it) and the plan's numbers on stderr. Without it: the planned peak
(GiB) of the config as given. ::

    python tools/full8_plan.py --config recipes/qwen3_30b_a3b_moe.yaml --world-size 8 \\
        --device-memory-gib 79.1 --fit-layers --set checkpoint.load=null
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_grpo.megatron.plan.memory import GIB  # noqa: E402
from megatron_grpo.megatron.plan.recompute import HEADROOM  # noqa: E402


@dataclass(frozen=True)
class Plan:
    """The dry run of one config: decoder layers, per-rank peak and budget (GiB), the activation
    recompute it plans with (``recompute_granularity: auto`` resolved)."""

    layers: int
    peak_gib: float
    budget_gib: float
    recompute: str


def plan(config: str | Path, overrides: Sequence[str], world_size: int, device_gib: float) -> Plan:
    """The dry run's plan of ``config`` + ``overrides`` on ``world_size`` ranks of
    ``device_gib`` GiB each (ValueError / ConfigError naming the field when it does not lay out)."""
    from megatron_grpo.train.config import load_train_config
    from megatron_grpo.train.dry_run import dry_run, resolve_recompute

    cfg = load_train_config(config, list(overrides))
    run = dry_run(cfg, world_size, file=io.StringIO(), device_memory_gib=device_gib)
    label = resolve_recompute(cfg, run.layout.sizes["dp"], device_gib * GIB).label
    return Plan(cfg.model.num_layers, run.plan.peak_bytes / GIB, (1 - HEADROOM) * device_gib, label)


def layer_step(config: str | Path, overrides: Sequence[str]) -> tuple[int, int]:
    """(pipeline stages PP x VPP: the layer count's multiple, the config's layer count)."""
    from megatron_grpo.train.config import load_train_config

    cfg = load_train_config(config, list(overrides))
    par = cfg.parallel
    stages = par.pipeline_model_parallel_size * (par.virtual_pipeline_model_parallel_size or 1)
    return stages, cfg.model.num_layers


def fit_layers(
    config: str | Path, overrides: Sequence[str], world_size: int, device_gib: float
) -> Plan:
    """The plan with the most layers (a multiple of PP x VPP, at most the config's) whose peak
    fits the budget; ValueError when not even one stage's worth fits."""
    step, most = layer_step(config, overrides)

    def at(n: int) -> Plan:
        return plan(config, [*overrides, f"model.num_layers={n}"], world_size, device_gib)

    lo, hi = 0, most // step  # multiples of step: lo fits (0: none yet), above hi not tried
    best = None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        p = at(mid * step)
        if p.peak_gib <= p.budget_gib:
            lo, best = mid, p
        else:
            hi = mid - 1
    if best is None:
        p = at(step)
        raise ValueError(
            f"model.num_layers={step} (one per pipeline stage) already plans {p.peak_gib:.1f} "
            f"GiB per rank, over the budget of {p.budget_gib:.1f} GiB "
            f"({1 - HEADROOM:.2f} x {device_gib:.1f} GiB) on {world_size} ranks"
        )
    return best


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--device-memory-gib", type=float, required=True)
    ap.add_argument("--fit-layers", action="store_true")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    try:
        if a.fit_layers:
            p = fit_layers(a.config, a.overrides, a.world_size, a.device_memory_gib)
        else:
            p = plan(a.config, a.overrides, a.world_size, a.device_memory_gib)
    except ValueError as e:  # ConfigError is one
        print(f"full8_plan: {e}", file=sys.stderr)
        return 2
    print(
        f"{a.config} on {a.world_size} ranks of {a.device_memory_gib:.1f} GiB: {p.layers} "
        f"layers plan {p.peak_gib:.2f} GiB per rank (budget {p.budget_gib:.2f} GiB); "
        f"recompute {p.recompute}",
        file=sys.stderr,
    )
    print(p.layers if a.fit_layers else f"{p.peak_gib:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
