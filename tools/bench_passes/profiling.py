"""``--profile`` (torch.profiler kernel tables and Chrome traces of one pass of each kind per
variant) and ``--host-profile`` (cProfile: where a host-bound pass spends its time)."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from .batches import batch_seed, make_batches, set_old_logprobs
from .dist import RANK, WORLD
from .report import label, print_profile
from .timing import sync


def _busy_us(spans: list[tuple[float, float]]) -> float:
    """The union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def _device_events(prof, dev) -> list:
    """The GPU's kernels / memcpys / memsets; on CPU (dry run) the leaf CPU ops instead."""
    from torch.autograd import DeviceType

    if dev.type == "cuda":
        return [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [e for e in prof.events() if e.device_type == DeviceType.CPU and not e.cpu_children]


def profile_pass(name: str, fn, setup, args, dev, out: Path, tag: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    setup()
    sync(dev)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(dev)
        wall_ms = (time.perf_counter() - t0) * 1e3
    trace = out / f"trace_{tag}_{name}{f'_rank{RANK}' if WORLD > 1 else ''}.json.gz"
    prof.export_chrome_trace(str(trace))
    events = _device_events(prof, dev)
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    groups: dict[str, list[float]] = {}
    for e in events:
        groups.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    total = sum(sum(t) for t in groups.values()) or 1e-30
    kernels = sorted((dict(name=n, calls=len(t), ms=sum(t), pct=100 * sum(t) / total)
                      for n, t in groups.items()), key=lambda r: -r["ms"])  # fmt: skip
    copies = sum(1 for e in events if e.name.startswith(("Memcpy", "Memset")))
    return dict(pass_=name, wall_ms=wall_ms, busy_ms=_busy_us(spans) / 1e3,
                launches=len(events) - copies, memcpy_memset=copies, device_ms=total,
                top=kernels[: args.top], trace=trace.name)  # fmt: skip


def host_profile(variants: dict, args, dev) -> None:
    """The Python functions that take the host's time in one pass of each kind (cProfile,
    sorted by own time): where a host-bound pass spends it."""
    import cProfile
    import io
    import pstats

    L = args.profile_len
    passes = variants[args.rope[-1]]
    batches = make_batches(L, args, seed=batch_seed(L, args))
    set_old_logprobs(batches, passes.logprob(batches), seed=batch_seed(L, args) + 1)
    passes.zero_grads()
    passes.train(batches)
    for name, fn in (("logprob", passes.logprob), ("train", passes.train)):
        passes.zero_grads()
        sync(dev)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        fn(batches)
        prof.disable()
        sync(dev)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
        print(
            f"\n== host profile L={L} rope={args.rope[-1]} {name}: wall "
            f"{(time.perf_counter() - t0) * 1e3:.1f} ms (under cProfile)\n{text.getvalue()}"
        )


def run_profile(variants: dict, args, dev, out: Path, experts: str) -> list[dict]:
    L = args.profile_len
    results = []
    for rope in args.rope:
        impl = label(args, experts, rope)
        passes = variants[rope]
        batches = make_batches(L, args, seed=batch_seed(L, args))
        set_old_logprobs(batches, passes.logprob(batches), seed=batch_seed(L, args) + 1)
        passes.zero_grads()
        passes.train(batches)  # warm (compiles, caches) before the profiled passes
        tag = f"L{L}_{impl.replace('/', '-').replace(':', '_')}"
        for name, fn in (("logprob", passes.logprob), ("train", passes.train)):
            r = profile_pass(name, partial(fn, batches), passes.zero_grads, args, dev, out, tag)
            r.update(L=L, rope=impl)
            results.append(r)
            print_profile(r, dev)
    return results
