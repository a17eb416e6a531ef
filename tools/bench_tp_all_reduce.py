"""The decode step's TP all-reduce: NCCL against one- and two-shot over symmetric memory (issue 42).

At TP = the torchrun world size, for each message ``[rows, hidden]`` in bf16: a CUDA graph of
``--per-graph`` back-to-back all-reduces (a decode step's 2 a layer, replayed as the engine
replays its steps), through ``dist.all_reduce`` (NCCL) and through ``TPAllReduce`` with each
symmetric-memory kernel, timed over ``--iters`` replays: microseconds per all-reduce, each
kernel / NCCL, and its result's equality with NCCL's. The sizes each kernel wins at are the
tiers ``tp_all_reduce.MEASURED_AHEAD`` holds for this TP size. Writes
``OUT/bench_tp_all_reduce_tpN.json`` (rank 0).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m torch.distributed.run \\
      --standalone --nproc-per-node 4 tools/bench_tp_all_reduce.py --out gpu_out/ar
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_grpo.rollout.engine.tp_all_reduce import TPAllReduce  # noqa: E402


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32,64,128,256,512", help="comma list of batch rows")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--per-graph", type=int, default=72, help="all-reduces per graph (a step)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("gpu_out/ar"))
    return p.parse_args(argv)


def _graph(reduce, x: torch.Tensor, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of ``n`` chained all-reduces of ``x`` (each scaled back so values stay finite)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        reduce(x.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(n):
            y = reduce(y.clone()).mul_(0.5)
    return graph, y


def _time(graph: torch.cuda.CUDAGraph, iters: int, group) -> float:
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _nccl(group):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    return reduce


def main(argv=None) -> None:
    a = _args(argv)
    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device, group = torch.device("cuda", torch.cuda.current_device()), dist.group.WORLD
    rows = [int(r) for r in a.rows.split(",")]
    max_bytes = max(rows) * a.hidden * 2
    paths = {"nccl": _nccl(group)}
    for kernel in ("one_shot", "two_shot"):
        paths[kernel] = TPAllReduce(group, ((max_bytes, kernel),), device)
    results = []
    for r in rows:
        x = torch.randn(r, a.hidden, device=device, dtype=torch.bfloat16)
        row = dict(rows=r, kib=r * a.hidden * 2 / 1024)
        outs = {}
        for name, reduce in paths.items():
            graph, outs[name] = _graph(reduce, x, a.per_graph)
            row[f"{name}_us"] = _time(graph, a.iters, group) / a.per_graph * 1e6
        for kernel in ("one_shot", "two_shot"):
            row[f"{kernel}_equal"] = bool(torch.equal(outs[kernel], outs["nccl"]))
            row[f"{kernel}_vs_nccl"] = row[f"{kernel}_us"] / row["nccl_us"]
        results.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        a.out.mkdir(parents=True, exist_ok=True)
        report = dict(tp=tp, hidden=a.hidden, per_graph=a.per_graph, gpu=torch.cuda.get_device_name(),
                      torch=torch.__version__, results=results)  # fmt: skip
        (a.out / f"bench_tp_all_reduce_tp{tp}.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
