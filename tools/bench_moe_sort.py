"""MoE pairs by local expert: the one-launch counting sort against argsort (issue 38).

For each pair count ``N`` (decode steps: tokens x top-k, gathered over the expert group), expert
count and local share: a CUDA graph of ``--per-graph`` back-to-back sorts (a decode step's one a
MoE layer, replayed as the engine replays its steps) through each ``LayerKernels.moe_sort``
choice (``ops.layers.sort_keys``), timed over ``--iters`` replays: microseconds per sort, the
counting sort's speed-up, and its outputs' equality with argsort's. The sizes where it wins bound
``sort_keys.COUNTING_SORT_MAX_PAIRS``. Writes ``OUT/bench_moe_sort.json``. ``--device cpu`` runs
tiny shapes eagerly in Triton's interpreter (a dry run: no timings worth reading).

    python tools/bench_moe_sort.py --out gpu_out/sort
    python tools/bench_moe_sort.py --tiles 8x512,32x128,16x256 --out gpu_out/sort  # the tiles
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default="256,512,1024,2048,4096,8192,16384", help="comma list")
    p.add_argument("--experts", default="32:1,32:2,128:8", help="E:EP list (local = E / EP)")
    p.add_argument("--per-graph", type=int, default=48, help="sorts per graph (MoE layers)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--tiles", default="", help="counting-sort tiles to time besides auto: 8x512,32x128,..."
    )
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", type=Path, default=Path("gpu_out/sort"))
    return p.parse_args(argv)


def _graph(sort, ids, n: int):
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sort(ids)  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            out = sort(ids)
    return graph, out


def _time_us(graph, iters: int, per_graph: int) -> float:
    import torch

    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (iters * per_graph) * 1e6


def _row(n: int, experts: int, ep: int, args) -> dict:
    import torch
    from megatron_grpo.kernels import sort_keys as kernel

    from megatron_grpo.ops.layers.sort_keys import sort_keys

    local = experts // ep
    offset = local * (ep - 1)  # the last rank: its experts' pairs are not the first ids
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, experts, (n,), generator=g).to(args.device)
    row = {"pairs": n, "experts": experts, "ep": ep}
    outs = {}
    sorts = {c: (lambda x, c=c: sort_keys(x, offset, local, n, c)) for c in ("argsort", "counting")}
    for tile in filter(None, args.tiles.split(",")):  # the kernel with an explicit tile
        bp, bq = (int(v) for v in tile.split("x"))
        sorts[f"counting_{tile}"] = lambda x, t=(bp, bq): kernel(x, offset, local, n, tile=t)
    for choice, sort in sorts.items():
        if args.device == "cpu":
            outs[choice] = sort(ids)
            continue
        graph, outs[choice] = _graph(sort, ids, args.per_graph)
        row[f"{choice}_us"] = _time_us(graph, args.iters, args.per_graph)
    want = outs.pop("argsort")
    row["equal"] = all(all(map(torch.equal, o, want)) for o in outs.values())
    if args.device == "cuda":
        row["speedup"] = row["argsort_us"] / row["counting_us"]
    return row


def main(argv=None) -> int:
    args = _args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
    import torch

    rows = []
    pairs = [int(x) for x in args.pairs.split(",")]
    for spec in args.experts.split(","):
        experts, ep = (int(x) for x in spec.split(":"))
        rows += [_row(n, experts, ep, args) for n in pairs]
    print("| pairs | experts | EP (local) | argsort us | counting us | speed-up | equal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        a, c, s = (
            f"{r[k]:.1f}" if k in r else "-" for k in ("argsort_us", "counting_us", "speedup")
        )
        tiles = " ".join(
            f"{k[9:-3]}={v:.1f}"
            for k, v in r.items()
            if k.startswith("counting_") and k != "counting_us"
        )
        print(f"| {r['pairs']} | {r['experts']} | {r['ep']} ({r['experts'] // r['ep']}) | {a} "
              f"| {c} | {s} | {r['equal']} |{' ' + tiles if tiles else ''}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    (args.out / "bench_moe_sort.json").write_text(json.dumps({"device": device, "rows": rows}))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
