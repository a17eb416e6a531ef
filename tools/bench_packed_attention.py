"""Packed causal attention of the portable spec against other SDPA backends (GPU).

Times forward and forward+backward of ``packed_causal_attention`` (length-bucketed SDPA, GQA
through ``enable_gqa``) on T packed tokens of documents of length L, against the same call with
K/V expanded to the query heads under each SDPA backend (flash, cuDNN, memory-efficient) and,
where torch has it, ``torch.nn.attention.varlen.varlen_attn``. Reports ms and TFLOP/s (causal
attention FLOPs: forward 4 * n_q * d * L(L+1)/2 per document, backward 2.5x the forward).

    python tools/bench_packed_attention.py --doc-lens 8192,1024,128,32
    python tools/bench_packed_attention.py --device cpu --tokens 256 --doc-lens 64,16  # dry run

``--mixed LO-HI`` measures what new bucket shapes cost instead: ``--layouts`` micro-batches of
documents with lengths uniform in [LO, HI], each run once forward + backward ("cold": every new
``[B, n, S, d]`` shape builds cuDNN execution plans) and then again ("warm"), for each method
and, for "default" (the spec's call), each way of running the buckets (``--buckets``,
packed_attention.BUCKETS; a forced backend runs them "exact").

    python tools/bench_packed_attention.py --mixed 20-600 --layouts 24 --methods default,flash

"packed_varlen" and "packed_blocked" are the spec's other packed paths (``attention/choice.py``:
one varlen_attn call, one masked SDPA over fixed blocks), e.g. ``--mixed 20-1000 --methods
default,packed_varlen,packed_blocked`` for their cost against the buckets on new layouts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_grpo.megatron.attention.choice import packed_attention
from megatron_grpo.megatron.attention.packed import document_layout, packed_causal_attention
from megatron_grpo.megatron.attention.sdpa import sdpa


def _params(tokens: int, length: int, device) -> PackedSeqParams:
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=length, max_seqlen_kv=length)  # fmt: skip


def _backend_ctx(name: str):
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]  # fmt: skip
    return sdpa_kernel([backend])


def _method(name: str, scale: float, buckets: str = "plan_free"):
    """``fn(q, k, v, params)`` of a method: "default" (the spec's call: GQA without copies,
    documents of mixed lengths run as ``buckets`` says) or "<backend>" (K/V expanded to the
    query heads, that SDPA backend forced, buckets "exact")."""
    if name in ("packed_varlen", "packed_blocked"):
        impl = name.removeprefix("packed_")

        def masked(q, k, v, mask=None):  # SDPAttention._sdpa's call
            return sdpa(q, k, v, mask=mask, causal=mask is None, scale=scale)

        def packed(q, k, v, params):
            return packed_attention(q, k, v, params, impl=impl, sdpa=masked, scale=scale)

        return packed
    if name == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        def run(q, k, v, params):
            groups = q.size(1) // k.size(1)
            k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
            cu, n = params.cu_seqlens_q, params.max_seqlen_q
            # causal = a window of (-1, 0); torch 2.11 has no native GQA here
            return varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0), scale=scale)

        return run

    def call(q, k, v, mask=None):
        if name != "default":
            groups = q.size(1) // k.size(1)
            k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        return sdpa(q, k, v, mask=mask, causal=mask is None, scale=scale)

    def run(q, k, v, params):
        with _backend_ctx(name):
            how = buckets if name == "default" else "exact"  # "exact": the forced backend rules
            return packed_causal_attention(q, k, v, params, sdpa=call, buckets=how)

    return run


def _time(fn, iters: int, device) -> float:
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def _mixed_params(lo: int, hi: int, tokens: int, seed: int, device) -> PackedSeqParams:
    """Documents of lengths uniform in [lo, hi] filling ``tokens`` (the last one cut)."""
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < tokens:
        n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), tokens - total)
        lens.append(n)
        total += n
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lens), max_seqlen_kv=max(lens))  # fmt: skip


def plan_cost(args, device, dtype) -> list[dict]:
    """Cold (new layouts) against warm (the same layouts again) fwd+bwd ms per micro-batch."""
    lo, hi = (int(x) for x in args.mixed.split("-"))
    scale = 1 / math.sqrt(args.head_dim)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(args.tokens, args.heads, args.head_dim, generator=g, device=device,
                    dtype=dtype, requires_grad=True)  # fmt: skip
    k, v = (torch.randn(args.tokens, args.kv_heads, args.head_dim, generator=g, device=device,
                        dtype=dtype, requires_grad=True) for _ in range(2))  # fmt: skip
    grad = torch.randn_like(q)
    print("| method | buckets | distinct shapes | cold ms / micro-batch | warm ms / micro-batch "
          "| cold - warm |\n|---|---|---|---|---|---|")  # fmt: skip
    rows = []
    runs = [(m, b) for m in args.methods.split(",")
            for b in (args.buckets.split(",") if m == "default" else ["exact"])]  # fmt: skip
    for i, (method, buckets) in enumerate(runs):
        fn = _method(method, scale, buckets)
        # other seeds per row: a shape one row built must not warm the next
        layouts = [_mixed_params(lo, hi, args.tokens, 1000 * i + j, device)
                   for j in range(args.layouts)]  # fmt: skip
        distinct = {shape for p in layouts
                    for shape in document_layout(p, device).buckets.shapes}  # fmt: skip

        def passes(fn=fn, layouts=layouts) -> None:
            for p in layouts:
                fn(q, k, v, p).backward(grad)

        cold, warm = (_time_once(passes, device) / args.layouts for _ in range(2))
        rows.append(dict(method=method, buckets=buckets, distinct_shapes=len(distinct),
                         cold_ms=cold, warm_ms=warm, mixed=args.mixed, layouts=args.layouts))  # fmt: skip
        print(f"| {method} | {buckets} | {len(distinct)} | {cold:.2f} | {warm:.2f} | "
              f"{cold - warm:.2f} |", flush=True)  # fmt: skip
    return rows


def _time_once(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--doc-lens", default="8192,1024,128,32")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--methods", default="default,flash,cudnn,efficient,varlen")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--mixed", default=None, help="LO-HI: the plan-cost mode (see above)")
    ap.add_argument("--layouts", type=int, default=24, help="micro-batches of --mixed")
    ap.add_argument("--buckets", default="plan_free,exact", help="--mixed: how "
                    "\"default\" runs the buckets (packed_attention.BUCKETS)")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# packed causal attention, {name}, torch {torch.__version__}, T={args.tokens}, "
          f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, {dtype}")  # fmt: skip
    if args.mixed:
        rows = plan_cost(args, device, dtype)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench_packed_attention_mixed.json").write_text(json.dumps(rows, indent=1))
        return
    print("| L | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|")
    rows = []
    scale = 1 / math.sqrt(args.head_dim)
    for length in (int(x) for x in args.doc_lens.split(",")):
        params = _params(args.tokens, length, device)
        g = torch.Generator(device=device).manual_seed(0)
        shape = (args.tokens, args.heads, args.head_dim)
        kv_shape = (args.tokens, args.kv_heads, args.head_dim)
        q = torch.randn(shape, generator=g, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(kv_shape, generator=g, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))  # fmt: skip
        flops = 4 * args.heads * args.head_dim * (args.tokens // length) * length * (length + 1) / 2
        for method in args.methods.split(","):
            try:
                fn = _method(method, scale)
                inputs = (q, k, v, params)
                grad = torch.randn(shape, device=device, dtype=dtype)
                with torch.no_grad():
                    fwd = _time(lambda fn=fn, x=inputs: fn(*x), args.iters, device)
                both = _time(lambda fn=fn, x=inputs, g=grad: fn(*x).backward(g), args.iters, device)
            except Exception as e:  # a backend that refuses this shape: say so, go on
                print(f"| {length} | {method} | n/a: {type(e).__name__}: {str(e)[:80]} |")
                continue
            row = dict(L=length, method=method, fwd_ms=fwd, fwd_bwd_ms=both,
                       fwd_tflops=flops / fwd / 1e9, fwd_bwd_tflops=3.5 * flops / both / 1e9)  # fmt: skip
            rows.append(row)
            print(f"| {length} | {method} | {fwd:.3f} | {row['fwd_tflops']:.1f} | {both:.3f} | "
                  f"{row['fwd_bwd_tflops']:.1f} |")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_packed_attention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
