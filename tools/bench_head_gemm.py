"""Benchmark: the LM-head GEMM with a softmax epilogue (``kernels/head_gemm.py``) against cuBLAS.

One GPU, ``h [T, H] @ w[V, H]^T`` in bf16 (T = 8192, H = 4096, V = 151936 by default). For each
kernel config (``head_gemm._configs()`` plus the default) it times the stats epilogue without and
with the shifted-logits store and the gradient epilogue, next to cuBLAS writing bf16 and fp32
logits (``torch.mm``). Ratios are against cuBLAS bf16 in the same run::

    python tools/bench_head_gemm.py [--T 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
from megatron_grpo.kernels import head_gemm


def _time(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median ms of ``fn`` over ``reps`` CUDA-event timed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def _time_kind(res: dict, label: str, h, w, t, lse, g, out16, kind: str | None = None) -> None:
    """Kernel ``kind`` (default: ``label``) at its current config in the four modes."""
    kind = kind or label
    try:
        res[f"{label} stats"] = _time(lambda: head_gemm.head_gemm_stats(h, w, t, 1.0, False,
                                                                       kernel=kind))  # fmt: skip
        res[f"{label} stats+entropy"] = _time(
            lambda: head_gemm.head_gemm_stats(h, w, t, 1.0, True, kernel=kind)
        )
        res[f"{label} stats+shifted"] = _time(
            lambda: head_gemm.head_gemm_stats(h, w, t, 1.0, False, shifted=out16, kernel=kind)
        )
        res[f"{label} grad"] = _time(
            lambda: head_gemm.head_gemm_grad(h, w, t, 1.0, lse, g, out=out16, kernel=kind)
        )
    except Exception as e:  # noqa: BLE001 - report and go on
        res[f"error {label}"] = f"{type(e).__name__}: {e}"[:300]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    h = torch.randn(args.T, args.H, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(args.V, args.H, device=dev) * 0.02).to(torch.bfloat16)
    t = torch.randint(0, args.V, (args.T,), device=dev)
    flops = 2 * args.T * args.V * args.H
    out32 = torch.empty(args.T, args.V, device=dev)
    out16 = torch.empty(args.T, args.V, device=dev, dtype=torch.bfloat16)
    res = {
        "cublas_bf16": _time(lambda: torch.mm(h, w.t(), out=out16)),
        "cublas_fp32_out": _time(lambda: torch.mm(h, w.t(), out_dtype=torch.float32, out=out32)),
    }
    lse = torch.full((args.T,), 12.0, device=dev)
    g = torch.randn(args.T, device=dev)
    for kind in ("tma", "pointer"):
        _time_kind(res, kind, h, w, t, lse, g, out16)
    default_tma = dict(head_gemm.TMA_CONFIG)
    for bk, warps, stages in [(64, 8, 4), (128, 8, 2), (128, 8, 3)]:
        head_gemm.TMA_CONFIG.update(BLOCK_K=bk, num_warps=warps, num_stages=stages)
        _time_kind(res, f"tma BK{bk} w{warps} s{stages}", h, w, t, lse, g, out16, "tma")
    head_gemm.TMA_CONFIG.update(default_tma)
    configs = [dict(head_gemm.CONFIG)] + [
        {**c.kwargs, "BLOCK_N": head_gemm.STATS_BLOCK_N, "num_warps": c.num_warps,
         "num_stages": c.num_stages} for c in head_gemm._configs()
    ]  # fmt: skip
    for cfg in configs:
        label = "BM{BLOCK_M} BK{BLOCK_K} w{num_warps} s{num_stages}".format(**cfg)
        head_gemm.CONFIG.clear()
        head_gemm.CONFIG.update(cfg)
        try:
            res[f"stats {label}"] = _time(
                lambda: head_gemm.head_gemm_stats(h, w, t, 1.0, False, kernel="pointer")
            )
            res[f"stats+shifted {label}"] = _time(
                lambda: head_gemm.head_gemm_stats(
                    h, w, t, 1.0, False, shifted=out16, kernel="pointer"
                )
            )
            res[f"grad {label}"] = _time(
                lambda: head_gemm.head_gemm_grad(h, w, t, 1.0, lse, g, out=out16, kernel="pointer")
            )
        except (triton.runtime.errors.OutOfResources, RuntimeError) as e:
            res[f"error {label}"] = str(e)[:200]
    base = res["cublas_bf16"]
    for name, ms in res.items():
        if isinstance(ms, float):
            tf = flops / ms / 1e9
            print(f"{name:40s} {ms:8.2f} ms  {ms / base:5.3f}x cuBLAS bf16  {tf:6.0f} TFLOP/s")
        else:
            print(f"{name:40s} {ms}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"T": args.T, "H": args.H, "V": args.V, "gpu": torch.cuda.get_device_name()}
    (out / f"head_gemm_T{args.T}.json").write_text(json.dumps({"info": info, "ms": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
