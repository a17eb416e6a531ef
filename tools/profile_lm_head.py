"""Profile: where the time of one LM-head step goes (torch profiler, one GPU).

For each method of ``tools/bench_methods.py`` (forward + backward at H = 4096, V = 151936, bf16):
the median wall time, the GPU busy time (the union of kernel intervals of one profiled step),
the gaps (wall - busy: launch latency, host syncs, Python), the kernels grouped by name, and the
GEMMs (aten::mm / addmm) grouped by input shape with their TFLOP/s. ``--chunk-sizes`` times the
fused GRPO loss at explicit single-pass chunk sizes (rows per full-width chunk)::

    python tools/profile_lm_head.py [--T 8192] [--main-grad] [--methods fused_grpo triton]
        [--fused-path fused_single_pass] [--chunk-sizes 2048 3072 3200 4096] [--out DIR]

Prints tables and writes ``profile_T{T}.json`` (and one Chrome trace per method) under --out.
``--device cpu`` is a dry run of the same logic (Triton kernels in the interpreter; use tiny
``--T --H --V``), run by ``tests/test_tools.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::_scaled_mm")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--methods", nargs="+", default=["fused_grpo", "triton"])
    ap.add_argument("--chunk-sizes", type=int, nargs="*", default=[])
    ap.add_argument("--main-grad", action="store_true", help="fp32 weight.main_grad up front")
    ap.add_argument(
        "--fused-path",
        choices=["fused_single_pass", "fused_tiled", "op"],
        default=None,
        help="fused_grpo_loss's path= (default: the plan's choice)",
    )
    ap.add_argument("--memory-budget-gib", type=float, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profiled-steps", type=int, default=3, help="steps under the profiler")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run")
    ap.add_argument("--out", default=os.environ.get("OUT", "profile_out"))
    a = ap.parse_args()
    a.vocab_size, a.chunk_size = a.V, None
    gib = a.memory_budget_gib
    a.memory_budget = None if gib is None else int(gib * 2**30)
    return a


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    # Triton builds its library for the interpreter only if this is set before its first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from bench_logprobs import make_grpo, make_problem  # noqa: E402
from bench_methods import (  # noqa: E402
    METHODS,
    Problem,
    clear_grads,
    floor_ms,
    median_ms,
    method_plan,
    sync,
)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from megatron_grpo.ops import vocab_parallel_logprobs  # noqa: E402


def busy_ms(events) -> float:
    """The union of the kernels' [start, end) intervals, in ms."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    total += 0 if cur_e is None else cur_e - cur_s
    return total / 1e3  # us -> ms


def _kernels(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _by_name(kernels) -> list[dict]:
    groups: dict[str, list[float]] = {}
    for e in kernels:
        groups.setdefault(e.name[:90], []).append(e.time_range.elapsed_us() / 1e3)
    rows = [dict(name=n, calls=len(t), ms=sum(t)) for n, t in groups.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def _gemms(prof) -> list[dict]:
    """aten GEMM ops by input shapes: device ms and TFLOP/s (2 M N K per call)."""
    rows = []
    for avg in prof.key_averages(group_by_input_shape=True):
        if avg.key not in _GEMM_OPS or not avg.input_shapes:
            continue
        first = 0 if avg.key == "aten::mm" else 1  # addmm: (acc, a, b); out= comes last
        a, b = avg.input_shapes[first], avg.input_shapes[first + 1]
        if len(a) != 2 or len(b) != 2:
            continue
        ms = avg.device_time_total / 1e3
        flops = 2 * a[0] * a[1] * b[1] * avg.count
        rows.append(dict(op=avg.key, a=a, b=b, calls=avg.count, ms=ms,
                         tflops=flops / ms / 1e9 if ms else 0.0))  # fmt: skip
    return sorted(rows, key=lambda r: -r["ms"])


def profile_method(name: str, p: Problem, args, dev, out: Path) -> dict:
    """Timed median, then ``args.profiled_steps`` steps under the profiler run as the timer runs
    them (setup, sync, step, sync): per step the wall (host clock) and the GPU busy time."""
    step = METHODS[name][0]
    plan = method_plan(name, p)
    ms = median_ms(lambda: step(p), dev, args.warmup, args.reps, setup=lambda: clear_grads(p))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    windows = []
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(args.profiled_steps):
            clear_grads(p)
            sync(dev)
            t0 = time.perf_counter()
            step(p)
            sync(dev)
            windows.append((t0, time.perf_counter()))
    prof.export_chrome_trace(str(out / f"trace_{name}_T{args.T}.json"))
    kernels = _kernels(prof)
    walls = [(b - a) * 1e3 for a, b in windows]
    busy = busy_ms(kernels) / len(windows)  # setup kernels (zeroing) are tiny next to a step
    res = dict(plan=None if plan is None else str(plan), ms=ms, busy_ms=busy,
               profiled_wall_ms=walls, kernels=_by_name(kernels), gemms=_gemms(prof))  # fmt: skip
    res["gap_ms"] = ms - res["busy_ms"]
    clear_grads(p)
    return res


def chunk_sweep(p: Problem, sizes: list[int], args, dev) -> dict:
    """Median ms of the fused GRPO loss (single pass) at each chunk size."""
    step, res, budget = METHODS["fused_grpo"][0], {}, p.memory_budget
    p.memory_budget = 64 * 2**30  # a budget that admits every size: the chunk is explicit
    for c in sizes:
        p.chunk_size, p.fused_path = c, "fused_single_pass"
        try:
            res[c] = median_ms(
                lambda: step(p), dev, args.warmup, args.reps, setup=lambda: clear_grads(p)
            )
        except (ValueError, RuntimeError) as e:
            res[c] = f"{type(e).__name__}: {e}"[:200]
        clear_grads(p)
    p.chunk_size, p.fused_path, p.memory_budget = None, args.fused_path, budget
    return res


def _print(name: str, r: dict, floor: float) -> None:
    print(f"\n== {name}: {r['ms']:.2f} ms ({r['ms'] / floor:.3f}x floor), GPU busy "
          f"{r['busy_ms']:.2f} ms a step, gaps {r['gap_ms']:.2f} ms; profiled steps "
          f"{', '.join(f'{w:.2f}' for w in r['profiled_wall_ms'])} ms\n   plan: {r['plan']}")  # fmt: skip
    for k in r["kernels"][:14]:
        print(f"   {k['ms']:8.2f} ms {k['calls']:4d}x  {k['name']}")
    for g in r["gemms"]:
        print(f"   GEMM {g['op']:13s} {str(g['a']):16s} x {str(g['b']):16s} {g['calls']:3d}x "
              f"{g['ms']:8.2f} ms {g['tflops']:6.0f} TFLOP/s")  # fmt: skip


def main() -> int:
    args = ARGS or parse_args()
    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = make_problem(args.T, args, dev)
    with torch.no_grad():
        logp = vocab_parallel_logprobs(p.h, p.w, p.targets)
    p.grpo = make_grpo(logp.float(), args.seq_len)
    floor = floor_ms(p.h, p.w, args, dev)["ms"]
    print(f"T={args.T} H={args.H} V={args.V} main_grad={args.main_grad} floor {floor:.2f} ms")
    results = {"floor_ms": floor, "methods": {}}
    for name in args.methods:
        r = results["methods"][name] = profile_method(name, p, args, dev, out)
        _print(name, r, floor)
    if args.chunk_sizes:
        sweep = results["chunk_sweep"] = chunk_sweep(p, args.chunk_sizes, args, dev)
        for c, ms in sweep.items():
            print(f"fused single pass C={c:6d}: " + (f"{ms:.2f} ms ({ms / floor:.3f}x floor)"
                                                      if isinstance(ms, float) else ms))  # fmt: skip
    (out / f"profile_T{args.T}.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
