"""``python -m megatron_grpo.train --config recipes/tiny.yaml [--set a.b=value ...] [--resume]``.

``--dry-run [--world-size N]`` prints the rank layout and per-rank memory plan and exits.

Runs under ``torchrun`` (single node or multi-node rendezvous) or as a plain ``python`` process
(a world of one). On a CPU-only host the backend is gloo.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch.distributed as dist

from megatron_grpo.config import ConfigError
from megatron_grpo.train.config import load_train_config


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo.train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML recipe (e.g. recipes/tiny.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="A.B=VALUE",
        help="override a config value (YAML-parsed); repeatable",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from checkpoint.dir's latest checkpoint"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the parallel layout, print the rank groups and the per-rank memory plan "
        "(no GPU, no model, no torch.distributed), then exit",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="ranks assumed by --dry-run (default: $WORLD_SIZE or 1)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_train_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from megatron_grpo.megatron.dry_run import dry_run

        try:
            dry_run(cfg, args.world_size)
        except ValueError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        return 0
    # Imported after the config is valid: Megatron's import is slow and noisy.
    from megatron_grpo.train.trainer import Trainer

    try:
        Trainer(cfg, resume=args.resume).train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
