"""Decode attention alone (``kernels/decode_attention.py``): microseconds a call and the K/V
bytes read per second, for the engine's shapes, over key splits and tiles. One GPU:

    python tools/bench_decode_attention.py --out $OUT/attn
    python tools/bench_decode_attention.py --shapes 8b-tp4 --rows 512 --ctx 520 \\
        --splits auto,1,2,4,8 --tiles auto,64x4,32x2,128x8

A shape is (KV groups G, query heads a group R, head dim D): ``8b-tp4`` is one TP 4 rank of
Qwen3-8B (2 KV heads of 8), ``8b-tp2`` (4), ``8b`` / ``0.6b`` (8 KV heads; R 4 / 2),
``moe-twin`` (4 KV heads, R 4). Every row has the context ``--ctx`` (``--spread F``: uniform
lengths within ctx x (1 +- F)). Each call is timed as ``--iters`` calls replayed from one CUDA
graph (the engine's decode step is a graph); bandwidth counts every row's K and V once.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from megatron_grpo.kernels.decode_attention import decode_attention, num_splits
from megatron_grpo.kernels.decode_attention import tile as choose_tile

SHAPES = {  # name: (G, R, D)
    "8b-tp4": (2, 4, 128),
    "8b-tp2": (4, 4, 128),
    "8b": (8, 4, 128),
    "0.6b": (8, 2, 128),
    "moe-twin": (4, 4, 128),
}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8b-tp4,8b-tp2,0.6b,moe-twin")
    p.add_argument("--rows", default="64,256,512")
    p.add_argument("--ctx", default="260,520,1288")
    p.add_argument("--spread", type=float, default=0.0)
    p.add_argument("--splits", default="auto,1,2,4,8")
    p.add_argument("--tiles", default="auto", help="auto or BLOCK_N x num_warps, comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    return p.parse_args()


def _inputs(shape: str, rows: int, ctx: int, spread: float, seed: int = 0):
    groups, heads, d = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(rows, groups, heads, d, device="cuda", generator=g).bfloat16()
    cap = int(ctx * (1 + spread)) + 1
    k = torch.randn(rows, groups, cap, d, device="cuda", generator=g).bfloat16()
    v = torch.randn_like(k)
    lo, hi = max(1, int(ctx * (1 - spread))), max(1, int(ctx * (1 + spread)))
    lens = torch.randint(lo, hi + 1, (rows,), device="cuda", generator=g)
    return q, k, v, lens - 1, cap


def _time(fn, iters: int) -> float:
    """Microseconds a call: ``iters`` calls captured in one CUDA graph (as the engine's decode
    step replays them: no host time between kernels), the mean of three replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (3 * iters)


def _case(args, shape: str, rows: int, ctx: int) -> list[dict]:
    q, k, v, pos, cap = _inputs(shape, rows, ctx, args.spread)
    nbytes = int((pos + 1).sum()) * k.shape[1] * k.shape[3] * 2 * k.element_size()
    want = decode_attention(q, k, v, pos, cap, 0.088)
    out = []
    for split in args.splits.split(","):
        for tile in args.tiles.split(","):
            n = None if split == "auto" else int(split)
            block_n, warps = (None, None) if tile == "auto" else map(int, tile.split("x"))
            kw = dict(splits=n, block_n=block_n, num_warps=warps)
            try:
                got = decode_attention(q, k, v, pos, cap, 0.088, **kw)
                err = (got.float() - want.float()).abs().max().item()
                us = _time(
                    lambda kw=kw: decode_attention(q, k, v, pos, cap, 0.088, **kw), args.iters
                )
            except Exception as e:  # a tile that does not fit the SM's shared memory
                print(f"{shape} rows={rows} ctx={ctx} splits={split} tile={tile}: {e!r:.120}")
                continue
            used = num_splits(rows, k.shape[1], cap) if n is None else n
            name = tile
            if tile == "auto":
                name = "auto={}x{}".format(*choose_tile(rows * k.shape[1] * used))
            row = dict(shape=shape, rows=rows, ctx=ctx, splits=split, used=used, tile=name,
                       us=round(us, 2), tbps=round(nbytes / us / 1e6, 3), max_diff=err)  # fmt: skip
            print(" ".join(f"{k_}={v_}" for k_, v_ in row.items()), flush=True)
            out.append(row)
    return out


def main() -> None:
    args = _args()
    torch.cuda.init()
    print(torch.cuda.get_device_name(), torch.__version__)
    rows = []
    for shape in args.shapes.split(","):
        for n in (int(x) for x in args.rows.split(",")):
            for ctx in (int(x) for x in args.ctx.split(",")):
                rows += _case(args, shape, n, ctx)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_attention.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
