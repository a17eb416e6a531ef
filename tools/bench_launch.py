"""Host time per call of the training passes' small ops: where a launch-bound pass spends it.

A pass is launch-bound when the host takes longer to issue a kernel than the GPU to run it (the
MoE twin's update keeps the GPU busy about half the time). This times each op on tiny inputs,
so the GPU finishes every kernel at once and the wall time per call is the host's: a plain aten
op (the baseline), an empty Triton kernel, and the portable spec's Triton ops (RMSNorm, RoPE,
SwiGLU: forward without autograd, and forward + backward through their autograd Functions).
One GPU; numbers are microseconds per call (median of 5 runs of ``--calls`` calls).

    python tools/bench_launch.py [--calls 2000] [--rows 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import triton


@triton.jit
def _empty_kernel(x_ptr, n):
    pass


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median wall microseconds per call of ``fn`` over 5 runs (the device drained after each)."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def cases(rows: int) -> dict[str, Callable[[], object]]:
    from megatron_grpo.ops.layers.rms_norm import rms_norm
    from megatron_grpo.ops.layers.rope import apply_rotary
    from megatron_grpo.ops.layers.swiglu import swiglu

    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(rows, 1024, device=dev, dtype=bf16)
    w = torch.ones(1024, device=dev, dtype=bf16)
    q = torch.randn(rows, 16, 128, device=dev, dtype=bf16)
    cos = torch.randn(rows, 128, device=dev, dtype=bf16)
    sin = torch.randn(rows, 128, device=dev, dtype=bf16)
    h = torch.randn(rows, 768, device=dev, dtype=bf16)
    probs = torch.rand(rows, device=dev, dtype=torch.float32)
    xg, wg, qg, hg = (t.clone().requires_grad_() for t in (x, w, q, h))

    def fwd_bwd(make):
        return lambda: make().sum().backward()

    return {
        "aten add (baseline)": lambda: x.add(1),
        "empty Triton kernel": lambda: _empty_kernel[(1,)](x, 1),
        "rms_norm fwd": lambda: rms_norm(x, w, 1e-6, impl="triton"),
        "rms_norm fwd, torch": lambda: rms_norm(x, w, 1e-6, impl="torch"),
        "sum + backward (baseline for fwd+bwd)": fwd_bwd(lambda: xg * 1),
        "rms_norm fwd+bwd": fwd_bwd(lambda: rms_norm(xg, wg, 1e-6, impl="triton")),
        "rope fwd": lambda: apply_rotary(q, cos, sin, interleaved=False, impl="triton"),
        "rope fwd+bwd": fwd_bwd(
            lambda: apply_rotary(qg, cos, sin, interleaved=False, impl="triton")
        ),
        "swiglu (scaled) fwd": lambda: swiglu(h, impl="triton", probs=probs),
        "swiglu (scaled) fwd+bwd": fwd_bwd(lambda: swiglu(hg, impl="triton", probs=probs)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rows", type=int, default=64)
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"\n| op ({a.rows} rows) | host us / call |\n|---|---|")
    for name, fn in cases(a.rows).items():
        print(f"| {name} | {host_us(fn, a.calls):.1f} |")


if __name__ == "__main__":
    main()
