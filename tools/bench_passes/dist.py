"""The process layout: one process (TP 1, EP 1) or torchrun's ranks for ``--tp N`` / ``--ep N``
(data-parallel size 1 under ``--tp``; every EP rank its own micro-batches), and ``--tp 1,2,4``,
one torchrun per size (``tools/bench_tp.py``). Rank 0 prints and writes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def silence_other_ranks() -> None:
    """torchrun: rank 0 prints the tables and writes the results."""
    if RANK:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115


def set_device(dev: torch.device) -> None:
    """The rank's GPU (``LOCAL_RANK``; 0 without torchrun)."""
    if dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def check_world(tp: int, ep: int, world: int = WORLD) -> None:
    """The world size torchrun gave against ``--tp`` / ``--ep`` (exits naming both)."""
    if ep == 1 and world != tp:
        raise SystemExit(f"--tp {tp} needs torchrun --nproc-per-node {tp} "
                         f"(world size {world}; the timings use data-parallel size 1)")  # fmt: skip
    if ep > 1 and (world % tp or world % ep):
        raise SystemExit(f"--ep {ep} --tp {tp}: the world size {world} must be a "
                         "multiple of both (torchrun --nproc-per-node)")  # fmt: skip


def tp_sweep(script: str, sizes: list[int], out: Path) -> int:
    """``--tp 1,2,4``: each size under its own torchrun of ``script`` with this command's
    arguments, their MFU side by side; the exit status."""
    if "RANK" in os.environ:
        raise SystemExit("--tp: under torchrun give one size (a list runs torchrun itself)")
    import bench_tp  # noqa: PLC0415 (tools/ is the script's path)

    return bench_tp.sweep(script, sys.argv[1:], sizes, out)
