"""Clocks: ``--warmup`` runs, then each of ``--iters`` between ``synchronize`` +
``perf_counter``; and the GEMM floor (cuBLAS alone on a pass's dense GEMMs, random tensors)."""

from __future__ import annotations

import statistics
import time

import torch

GIB = 2**30


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, warmup: int, iters: int, setup=None) -> tuple[list[float], float | None]:
    """(ms of each of ``iters`` runs after ``warmup``, peak GiB over the timed runs)."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        if setup:
            setup()
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / GIB if dev.type == "cuda" else None
    return times, peak


def _mm_ms(m: int, k: int, n: int, dev, dtype, reps: int) -> tuple[float, float, float]:
    """Median ms of the GEMMs of one linear layer on m rows: forward [m,k]x[k,n], d input
    [m,n]x[n,k], d weight [n,m]x[m,k] (random inputs)."""
    x = torch.randn(m, k, device=dev, dtype=dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype)
    g = torch.randn(m, n, device=dev, dtype=dtype)
    out = []
    for fn in (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x):
        times, _ = timed(fn, dev, 2, reps)
        out.append(statistics.median(times))
    return tuple(out)


def gemm_floor(gpt, args, dev, scored_rows: int) -> dict:
    """cuBLAS time of the dense GEMMs of one pass over all micro-batches: every decoder weight
    [n, k] on ``--tokens`` rows per layer, the LM head on the micro-batch's loss-mask rows."""
    dtype = next(gpt.parameters()).dtype
    shapes = [(args.tokens, p.shape[1], p.shape[0]) for n, p in gpt.named_parameters()
              if p.dim() == 2 and n.startswith("decoder.layers.0.") and ".experts." not in n]  # fmt: skip
    cfg = gpt.config
    if cfg.num_moe_experts:  # the routed rows through one expert's shapes: one ideal GEMM each
        rows, fc1 = args.tokens * cfg.moe_router_topk, 2 * cfg.moe_ffn_hidden_size
        shapes += [(rows, cfg.hidden_size, fc1), (rows, cfg.moe_ffn_hidden_size, cfg.hidden_size)]
    fwd = bwd = 0.0
    for m, k, n in shapes:
        f, di, dw = _mm_ms(m, k, n, dev, dtype, args.floor_reps)
        fwd, bwd = fwd + f * args.layers, bwd + (di + dw) * args.layers
    rows = max(1, round(scored_rows / args.micro_batches))
    vocab = -(-args.vocab // args.tp_size)  # the vocab-parallel head's rows on this rank
    f, di, dw = _mm_ms(rows, args.hidden, vocab, dev, dtype, args.floor_reps)
    fwd, bwd = (fwd + f) * args.micro_batches, (bwd + di + dw) * args.micro_batches
    return dict(logprob_ms=fwd, train_ms=fwd + bwd)
