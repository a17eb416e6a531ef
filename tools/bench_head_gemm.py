"""Benchmark: the LM-head GEMM with a softmax epilogue (``kernels/head_gemm.py``) against cuBLAS.

One GPU, ``h [T, H] @ w[V, H]^T`` in bf16 (T = 8192, H = 4096, V = 151936 by default). For each
kernel config (``head_gemm._configs()`` plus the default) it times the stats epilogue without and
with the shifted-logits store and the gradient epilogue, next to cuBLAS writing bf16 and fp32
logits (``torch.mm``). Ratios are against cuBLAS bf16 in the same run. Then the single pass's
d_weight GEMM of one ``--wgrad-rows`` chunk (``dlogits^T [V, C] @ h [C, H]``): the split
accumulator (``kernels/split_accumulator.py``, a few tile configs) against cuBLAS adding into an
fp32 buffer (the ``main_grad`` path) and cuBLAS writing bf16 (ratios against the latter)::

    python tools/bench_head_gemm.py [--T 8192] [--wgrad-rows 1344] [--wgrad-only] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
from megatron_grpo.kernels import head_gemm, split_accumulator

from megatron_grpo.ops.lm_head.gemm import mm_f32

# BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs per SM (the TMA kernel; each fits: the
# sm_90 compile's shared memory and registers, tools/kernel_resources.py)
SPLIT_CONFIGS = [
    (128, 128, 64, 8, 4, 1), (128, 128, 64, 8, 3, 1), (64, 128, 64, 4, 4, 1),
    (128, 64, 64, 8, 3, 1), (128, 64, 64, 8, 3, 2), (128, 64, 64, 4, 3, 2),
    (64, 128, 64, 4, 3, 2), (128, 64, 32, 4, 4, 2), (128, 64, 64, 4, 2, 2), (64, 64, 64, 4, 4, 2),
]  # fmt: skip


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


def _time_wgrad(args, dev) -> dict:
    """ms of one chunk's d_weight GEMM, the split accumulator against cuBLAS."""
    c, v, hd = args.wgrad_rows, args.V, args.H
    dl = (torch.randn(c, v, device=dev) * 1e-3).to(torch.bfloat16)
    h = torch.randn(c, hd, device=dev, dtype=torch.bfloat16)
    hi = torch.empty(v, hd, device=dev, dtype=torch.bfloat16)
    lo = torch.zeros(v, hd, device=dev, dtype=torch.int8)
    acc32 = torch.zeros(v, hd, device=dev)
    res = {
        "wgrad cublas_bf16": _time(lambda: torch.mm(dl.t(), h, out=hi)),
        "wgrad cublas_fp32_acc": _time(lambda: mm_f32(dl.t(), h, acc=acc32)),
    }
    for bm, bn, bk, warps, stages, ctas in SPLIT_CONFIGS:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                   CTAS_PER_SM=ctas)  # fmt: skip
        for kind in ("tma", "pointer") if ctas == 1 else ("tma",):
            label = f"wgrad split {kind} {bm}x{bn} BK{bk} w{warps} s{stages} c{ctas}"
            try:
                split_accumulator.split_acc_addmm(dl, h, hi, lo, True, kind, cfg)
                res[label] = _time(
                    lambda k=kind, c=cfg: split_accumulator.split_acc_addmm(
                        dl, h, hi, lo, False, k, c
                    )  # fmt: skip
                )
            except Exception as e:  # noqa: BLE001 - report and go on
                res[f"error {label}"] = f"{type(e).__name__}: {e}"[:300]
    res["wgrad split resolve"] = _time(
        lambda: split_accumulator.split_acc_resolve(hi, lo, torch.ones(1, device=dev))
    )
    return res


def _print(res: dict, base_key: str, flops: int) -> None:
    base = res[base_key]
    for name, ms in res.items():
        if isinstance(ms, float):
            tf = flops / ms / 1e9
            print(f"{name:44s} {ms:8.3f} ms  {ms / base:5.3f}x {base_key}  {tf:6.0f} TFLOP/s")
        else:
            print(f"{name:44s} {ms}")


def _time_head(args, dev) -> dict:
    """ms of the head GEMM's kernels and configs against cuBLAS (printed)."""
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
    # the TMA store's staging tile leaves no shared memory for a 4th stage or 128-deep K steps
    for bk, warps, stages, store in [(64, 8, 3, False), (64, 8, 4, False), (128, 8, 2, False)]:
        head_gemm.TMA_CONFIG.update(BLOCK_K=bk, num_warps=warps, num_stages=stages,
                                    TMA_STORE=store)  # fmt: skip
        label = f"tma BK{bk} w{warps} s{stages}" + ("" if store else " pointer-store")
        _time_kind(res, label, h, w, t, lse, g, out16, "tma")
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
    _print(res, "cublas_bf16", flops)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--wgrad-rows", type=int, default=1344, help="0: skip the d_weight GEMM")
    ap.add_argument("--wgrad-only", action="store_true", help="time only the d_weight GEMM")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    res = {} if args.wgrad_only else _time_head(args, dev)
    if args.wgrad_rows:
        wgrad = _time_wgrad(args, dev)
        _print(wgrad, "wgrad cublas_bf16", 2 * args.wgrad_rows * args.V * args.H)
        res.update(wgrad)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"T": args.T, "H": args.H, "V": args.V, "gpu": torch.cuda.get_device_name()}
    (out / f"head_gemm_T{args.T}.json").write_text(json.dumps({"info": info, "ms": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
