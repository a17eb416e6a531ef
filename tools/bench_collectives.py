"""NCCL bandwidth of the MoE dispatches' collectives at the sizes training moves (issue 38).

The gathered dispatch all-gathers each layer's tokens over the expert group and reduce-scatters
the partial expert outputs; megatron-core's dispatcher moves them with all-to-all. A profile of
the MoE twin at EP 4 showed these kernels at 1-1.6 ms for 32-256 MB, several times what NVLink
carries; this says what NCCL alone reaches at those sizes on this host, so a profile's
collective time can be split into bandwidth and waiting for the other ranks. For each op, dtype
and per-rank input size: the median time of ``--iters`` back-to-back calls (after a barrier, no
host work in between), algorithm and bus bandwidth (nccl-tests' definitions). Writes
``OUT/bench_collectives_wN.json`` (rank 0).

    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc-per-node 4 \\
      tools/bench_collectives.py --out gpu_out/coll
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

OPS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", default="1,8,32,64,128", help="per-rank input sizes (MiB), comma list")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("gpu_out/coll"))
    return p.parse_args(argv)


def _call(op: str, x: torch.Tensor, world: int) -> Callable[[], None]:
    """One collective over ``x`` (the per-rank input) into a preallocated output."""
    if op == "all_gather":
        out = x.new_empty(world * x.numel())
        return lambda: dist.all_gather_into_tensor(out, x)
    if op == "reduce_scatter":
        out = x.new_empty(x.numel() // world)
        return lambda: dist.reduce_scatter_tensor(out, x)
    if op == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x)
    raise SystemExit(f"--ops: unknown op {op!r}; choose from {', '.join(OPS)}")


def _bus_factor(op: str, world: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth."""
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def measure(op: str, dtype: torch.dtype, mib: float, iters: int) -> dict:
    world = dist.get_world_size()
    elems = int(mib * 2**20) // dtype.itemsize // world * world
    x = torch.ones(elems, dtype=dtype, device="cuda")
    call = _call(op, x, world)
    call()  # warm-up: NCCL's channels and buffers
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    t = statistics.median(times)
    # the bytes nccl-tests count: the larger of input and output
    size = x.numel() * dtype.itemsize * (world if op == "all_gather" else 1)
    algbw = size / t / 1e9
    return dict(
        op=op,
        dtype=str(dtype).removeprefix("torch."),
        mib_in=mib,
        world=world,
        ms=t * 1e3,
        algbw_gbs=algbw,
        busbw_gbs=algbw * _bus_factor(op, world),
    )


def main(argv=None) -> None:
    args = _args(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rows = []
    for op in args.ops.split(","):
        for name in args.dtypes.split(","):
            for mib in map(float, args.mib.split(",")):
                rows.append(measure(op, getattr(torch, name), mib, args.iters))
    if dist.get_rank() == 0:
        print("| op | dtype | MiB in / rank | ms | algbw GB/s | busbw GB/s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['op']} | {r['dtype']} | {r['mib_in']:g} | {r['ms']:.3f} | "
                f"{r['algbw_gbs']:.0f} | {r['busbw_gbs']:.0f} |"
            )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"bench_collectives_w{dist.get_world_size()}.json").write_text(
            json.dumps(rows, indent=1)
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
