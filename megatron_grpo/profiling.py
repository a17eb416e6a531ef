"""Trainer steps under ``torch.profiler`` (``logging.profile_step_start`` .. ``_end``).

Each rank of ``logging.profile_ranks`` writes, under ``<logging.dir>/profile/``:

* ``rank<R>_steps<a>-<b>.json.gz``: the Chrome / Perfetto trace, the stages (rollout, logprob,
  update, ...) marked as ranges;
* ``rank<R>_steps<a>-<b>.md``: where the device time went. Wall seconds of the profiled steps,
  device-busy seconds (the union of kernel intervals) and idle (the rest: host-bound gaps,
  syncs), kernel time by kind (collectives, GEMMs, attention, copies, other) and the top kernels.
  On a CPU-only run the leaf CPU ops stand in for kernels.

Steps are 1-based, as the console prints them. Profiling costs host time: the profiled steps'
own metrics are slower than the others'.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

# Kernel kinds by name fragment (lower case), first match wins; "other" for the rest.
_COLLECTIVE = "nccl gloo: c10d:: all_reduce allreduce all_gather allgather reduce_scatter"
_COLLECTIVE += " reducescatter all_to_all alltoall broadcast sendrecv"
KINDS = (
    ("collective", tuple(_COLLECTIVE.split())),
    ("gemm", tuple("gemm nvjet xmma cutlass cublas matmul aten::mm aten::addmm aten::bmm".split())),
    ("attention", ("attn", "attention", "flash", "fmha", "sdpa")),
    ("copy", ("memcpy", "memset", "copy_")),
)
TOP = 25  # kernels listed in the table


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KINDS if any(p in low for p in parts)), "other")


class StepProfiler:
    """Profiles steps ``start .. end`` (1-based, inclusive) on the global ranks in ``ranks``
    into ``log_dir/profile``; a no-op elsewhere or with ``start`` None (the trainer's ranks:
    separate placement's generation ranks run no trainer steps)."""

    def __init__(
        self,
        start: int | None,
        end: int | None,
        ranks: list[int],
        log_dir: str,
        with_stack: bool = False,
    ) -> None:
        """``with_stack``: also record Python stacks (``tools/trace_stage.py`` then charges the
        host time of ops to the source lines that called them; the steps run slower still)."""
        self.start, self.end = start, (start if end is None else end)
        self.with_stack = with_stack
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.on = start is not None and self.rank in ranks
        self.out = Path(log_dir) / "profile"
        self._prof = None
        self._t0 = 0.0
        if self.on and torch.cuda.is_available():
            init_for_cuda_graphs()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wraps trainer step ``step`` (1-based)."""
        if self.on and step == self.start:
            self._begin()
        try:
            yield
        finally:
            if self._prof is not None and step == self.end:
                self._finish()

    def _begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = profile(activities=acts, with_stack=self.with_stack)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def _finish(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"rank{self.rank}_steps{self.start}-{self.end}"
        prof.export_chrome_trace(f"{stem}.json.gz")
        Path(f"{stem}.md").write_text(report(prof.events(), wall, self.rank, self.start, self.end))
        print(f"profile: {stem}.md (+ .json.gz trace)", flush=True)


def init_for_cuda_graphs() -> None:
    """Start the profiler's CUDA side once before any CUDA graph is captured: profiling replays
    of graphs captured before the profiler's first use can hang in its stop or fault (torch
    issues 75504, 135003; torch's own workaround, ``_init_for_cuda_graphs``). The engine
    captures its decode graphs in the first rollout, so this runs when the trainer is built."""
    from torch.profiler import _utils

    _utils._init_for_cuda_graphs()


def report(events, wall: float, rank: int, start: int, end: int) -> str:
    """The markdown summary of one profile (module docstring)."""
    kernels = device_events(events)
    busy = union_seconds([(e.time_range.start, e.time_range.end) for e in kernels])
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e6)
    total = sum(sum(t) for t in by_name.values()) or 1e-30
    kinds: dict[str, float] = {}
    for name, times in by_name.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + sum(times)
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
    lines = [
        f"# Profile: rank {rank}, steps {start}-{end}",
        "",
        f"wall {wall:.3f} s; device busy {busy:.3f} s ({100 * busy / wall:.0f}%), "
        f"idle {max(wall - busy, 0.0):.3f} s; kernel time {total:.3f} s in {len(kernels)} "
        "launches",
        "",
        "| kind | s | % of kernel time |",
        "|---|---|---|",
        *(f"| {k} | {s:.3f} | {100 * s / total:.1f} |" for k, s in ranked),
        "",
        *stage_lines(events, kernels),
        "| kernel | kind | calls | s | % |",
        "|---|---|---|---|---|",
    ]
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP]:
        short = name if len(name) <= 90 else name[:87] + "..."
        short = short.replace("|", "/")
        pct = 100 * sum(times) / total
        lines.append(
            f"| `{short}` | {kind_of(name)} | {len(times)} | {sum(times):.4f} | {pct:.1f} |"
        )
    return "\n".join(lines) + "\n"


def stage_lines(events, kernels: list) -> list[str]:
    """Per trainer stage (the host's ``stage/...`` ranges, which end after a device
    synchronization: ``step_metrics.timed``): its span, the device-busy time inside it and the
    launches, so a host-bound stage shows as a low busy share. Empty without stage ranges. (The
    GPU's mirrored annotations are no measure of a stage: one per kernel at times.)"""
    from torch.autograd import DeviceType

    ranges = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("stage/")]
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in ranges:
        spans.setdefault(e.name[len("stage/") :], []).append((e.time_range.start, e.time_range.end))
    if not spans:
        return []
    lines = [
        "| stage | calls | span s | device busy s | busy % | launches |",
        "|---|---|---|---|---|---|",
    ]
    for name, parts in sorted(spans.items(), key=lambda kv: -sum(b - a for a, b in kv[1])):
        calls, parts = len(parts), merged(parts)
        span = sum(b - a for a, b in parts) / 1e6
        inside = [clip(e, parts) for e in kernels]
        busy = union_seconds([c for c in inside if c is not None])
        count = sum(c is not None for c in inside)
        pct = 100 * busy / span if span else 0.0
        lines.append(f"| {name} | {calls} | {span:.3f} | {busy:.3f} | {pct:.0f} | {count} |")
    return [*lines, ""]


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` sorted, overlapping ones joined."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def clip(event, spans: list[tuple[float, float]]) -> tuple[float, float] | None:
    """``event``'s interval cut to the last of ``spans`` (sorted, disjoint) that starts before
    it ends, if they overlap (None: they do not)."""
    s, e = event.time_range.start, event.time_range.end
    i = bisect.bisect_left(spans, (e, float("-inf"))) - 1
    if i < 0 or spans[i][1] <= s:
        return None
    return max(s, spans[i][0]), min(e, spans[i][1])


def device_events(events) -> list:
    """The GPU's kernels, copies and sets; without any (a CPU run) the leaf CPU ops. The
    ``record_function`` ranges (the ``stage/...`` marks) also appear on the GPU's timeline, as
    user annotations spanning the kernels they enclose: counting them would add each stage's
    wall time to the kernel time and hide the host-bound gaps, so they are left out."""
    from torch.autograd import DeviceType

    gpu = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    if gpu:
        return gpu
    return [e for e in events if e.device_type == DeviceType.CPU and not e.cpu_children]


def union_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals in microseconds, in seconds."""
    return sum(b - a for a, b in merged(spans)) / 1e6
