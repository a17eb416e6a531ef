"""Host time per call of the training passes' small ops: where a launch-bound pass spends it.

A pass is launch-bound when the host takes longer to issue a kernel than the GPU to run it (the
MoE twin's update keeps the GPU busy about half the time). This times each op on tiny inputs,
so the GPU finishes every kernel at once and the wall time per call is the host's: a plain aten
op (the baseline), an empty Triton kernel, and the portable spec's Triton ops (RMSNorm, RoPE,
SwiGLU: forward without autograd, and forward + backward through their autograd Functions),
and one layer's q / k RMSNorms + RoPE as four ops against the fused op
(``ops.layers.qk_norm_rope``). One GPU; numbers are microseconds per call (median of 5 runs of
``--calls`` calls). A second table times the same q / k step on the device at a real layer shape
(``--tokens`` tokens, Qwen3-8B's 32 q / 8 k heads of 128, bf16, forward + backward), where
the GPU, not the host, bounds it: the fused op must not be slower there.

    python tools/bench_launch.py [--calls 2000] [--rows 64] [--tokens 16384]
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

    kg = torch.randn(rows, 8, 128, device=dev, dtype=bf16, requires_grad=True)
    qk_layers = {
        "q / k rms_norm + rope, 4 ops, fwd+bwd": qk_chain(qg, kg, wg[:128], cos, sin, False),
        "q / k qk_norm_rope, 1 op, fwd+bwd": qk_chain(qg, kg, wg[:128], cos, sin, True),
    }
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
        **{f"{k} (per layer of {CHAIN})": v for k, v in qk_layers.items()},
    }


def qk_step(q, k, w, cos, sin, fused: bool):
    """One layer's q / k norms and RoPE: the fused op, or RMSNorm then RoPE on each tensor."""
    from megatron_grpo.ops.layers.qk_norm_rope import qk_norm_rope
    from megatron_grpo.ops.layers.rms_norm import rms_norm
    from megatron_grpo.ops.layers.rope import apply_rotary

    if fused:
        return qk_norm_rope(q, k, w, w, 1e-6, cos, sin, impl="triton")
    q = apply_rotary(rms_norm(q, w, 1e-6, impl="triton"), cos, sin, impl="triton")
    return q, apply_rotary(rms_norm(k, w, 1e-6, impl="triton"), cos, sin, impl="triton")


def qk_chain(q, k, w, cos, sin, fused: bool) -> Callable[[], None]:
    """``CHAIN`` layers' q / k steps in a row, then one backward through them."""

    def run():
        a, b = q, k
        for _ in range(CHAIN):
            a, b = qk_step(a, b, w, cos, sin, fused)
        (a.float().sum() + b.float().sum()).backward()

    return run


def device_us(tokens: int) -> dict[str, float]:
    """GPU microseconds of one layer's q / k step, forward + backward, at ``tokens`` tokens
    (CUDA events around 20 calls, median of 5)."""
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(tokens, 32, 128, device=dev, dtype=bf16, requires_grad=True)
    k = torch.randn(tokens, 8, 128, device=dev, dtype=bf16, requires_grad=True)
    w = torch.rand(128, device=dev, dtype=bf16, requires_grad=True)
    angle = torch.rand(tokens, 128, device=dev)
    cos, sin = angle.cos().to(bf16), angle.sin().to(bf16)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    out = {}
    for fused in (False, True):

        def run(fused=fused):
            torch.autograd.backward(qk_step(q, k, w, cos, sin, fused), (gq, gk))

        run()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / 20)
        out["fused (1 op)" if fused else "separate (4 ops)"] = statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16384)
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"\n| op ({a.rows} rows) | host us / call |\n|---|---|")
    for name, fn in cases(a.rows).items():
        per = CHAIN if f"of {CHAIN})" in name else 1  # chains: per op / per layer
        print(f"| {name} | {host_us(fn, max(1, a.calls // per)) / per:.1f} |")
    print(f"\n| q / k norms + RoPE, {a.tokens} tokens x (32 + 8) heads x 128 | GPU us fwd+bwd |")
    print("|---|---|")
    for name, us in device_us(a.tokens).items():
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
