"""Registers, spilled bytes and shared memory of the LM head's GPU kernels, on any machine.

Compiles every launch of ``kernels._aot.hopper_specs()`` for sm_90 with Triton's own ``ptxas``
(no GPU needed) and prints one line each; ``stack`` is local memory per thread, i.e. registers
``ptxas`` spilled (any spill in a GEMM epilogue costs time; see docs/benchmarks.md)::

    python tools/kernel_resources.py [--only head_gemm]
"""

from __future__ import annotations

import argparse

from megatron_grpo.kernels._aot import SM90_MAX_SHARED, compile_sm90, hopper_specs, resources


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="launches whose name contains this")
    args = ap.parse_args()
    print(f"{'launch':32s} {'warps':>5s} {'stages':>6s} {'regs':>5s} {'stack B':>7s} shared B")
    for spec in hopper_specs():
        if args.only not in spec.name:
            continue
        res = resources(compile_sm90(spec))
        over = "  OVER the sm_90 limit" if res.shared > SM90_MAX_SHARED else ""
        print(f"{spec.name:32s} {spec.num_warps:5d} {spec.num_stages:6d} {res.registers!s:>5s} "
              f"{res.stack!s:>7s} {res.shared}{over}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
