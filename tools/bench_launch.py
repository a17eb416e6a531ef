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


CHAIN = 16  # ops per backward: the autograd engine's fixed cost per backward() is shared


def cases(rows: int) -> dict[str, Callable[[], object]]:
    """Each case's per-op cost: forward cases are one call; "fwd+bwd" cases are a chain of
    ``CHAIN`` calls and one backward through them, timed per op (the total / CHAIN)."""
    from megatron_grpo.ops.kernels import triton_kernels
    from megatron_grpo.ops.layers.rms_norm import rms_norm
    from megatron_grpo.ops.layers.rope import apply_rotary
    from megatron_grpo.ops.layers.swiglu import swiglu

    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(rows, 1024, device=dev, dtype=bf16)
    w = torch.ones(1024, device=dev, dtype=bf16)
    q = torch.randn(rows, 16, 128, device=dev, dtype=bf16)
    cos = torch.randn(rows, 128, device=dev, dtype=bf16)
    sin = torch.randn(rows, 128, device=dev, dtype=bf16)
    probs = torch.rand(rows, device=dev, dtype=torch.float32)
    xg, wg, qg = x.clone().requires_grad_(), w.clone().requires_grad_(), q.clone().requires_grad_()
    hg = torch.randn(rows, 2 * 768, device=dev, dtype=bf16, requires_grad=True)
    _, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6)

    def chain(op, start):
        def run():
            y = start
            for _ in range(CHAIN):
                y = op(y)
            y.float().sum().backward()

        return run

    def rope_op(t):
        return apply_rotary(t, cos, sin, interleaved=False, impl="triton")

    def swiglu_op(t):  # [r, 2F] -> [r, F] -> [r, 2F] again (a cat): the chain keeps its shape
        out = swiglu(t, impl="triton", probs=probs)
        return torch.cat([out, out], dim=1)

    per_op = {
        "chain of x * 1 (baseline)": chain(lambda t: t * 1, xg),
        "rms_norm fwd+bwd": chain(lambda t: rms_norm(t, wg, 1e-6, impl="triton"), xg),
        "rms_norm fwd+bwd, torch": chain(lambda t: rms_norm(t, wg, 1e-6, impl="torch"), xg),
        "rope fwd+bwd": chain(rope_op, qg),
        "swiglu (scaled) + cat fwd+bwd": chain(swiglu_op, hg),
    }
    return {
        "aten add (baseline)": lambda: x.add(1),
        "empty Triton kernel": lambda: _empty_kernel[(1,)](x, 1),
        "rms_norm fwd": lambda: rms_norm(x, w, 1e-6, impl="triton"),
        "rms_norm fwd, torch": lambda: rms_norm(x, w, 1e-6, impl="torch"),
        "rms_norm_bwd launcher alone": lambda: triton_kernels.rms_norm_bwd(x, x, w, rstd),
        "rope fwd": lambda: apply_rotary(q, cos, sin, interleaved=False, impl="triton"),
        "swiglu (scaled) fwd": lambda: swiglu(hg.detach(), impl="triton", probs=probs),
        **{f"{k} (per op of {CHAIN})": v for k, v in per_op.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rows", type=int, default=64)
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"\n| op ({a.rows} rows) | host us / call |\n|---|---|")
    for name, fn in cases(a.rows).items():
        per = CHAIN if "per op" in name else 1
        print(f"| {name} | {host_us(fn, max(1, a.calls // per)) / per:.1f} |")


if __name__ == "__main__":
    main()
