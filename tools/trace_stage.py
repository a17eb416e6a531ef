"""Where one trainer stage's host time goes, from a profile's Chrome trace.

The trainer's profiler (``logging.profile_step_start``; ``megatron_grpo/profiling.py``) writes
``profile/rank<R>_steps<a>-<b>.json.gz`` with the stages marked as ``stage/<name>`` ranges. Its
markdown table says how busy the device was; for a host-bound stage this says what the host did
instead: the aten ops (count, own and inclusive host ms), the CUDA runtime calls (launches; syncs, where
the host waits for the device) and the kernels inside the stage. A trace recorded with Python stacks
(``logging.profile_with_stack``) also gets the aten ops' host time by the project source line that
called them (the innermost ``megatron_grpo`` or ``megatron/core`` frame).

    python3 tools/trace_stage.py run/profile/rank0_steps6-6.json.gz --stage update [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def stage_spans(events: list[dict], stage: str) -> list[tuple[float, float]]:
    name = f"stage/{stage}"
    spans = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["name"] == name and e.get("cat") == "user_annotation"
    ]
    if not spans:
        found = sorted({e["name"] for e in events if e["name"].startswith("stage/")})
        raise SystemExit(f"no range {name!r} in the trace; it has: {', '.join(found) or 'none'}")
    return spans


def inside(e: dict, spans: list[tuple[float, float]]) -> bool:
    return any(a <= e["ts"] < b for a, b in spans)


def table(title: str, rows: dict[str, list[float]], top: int) -> list[str]:
    lines = [f"## {title}", "", "| name | calls | ms | us / call |", "|---|---|---|---|"]
    ranked = sorted(rows.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, durs in ranked:
        short = (name if len(name) <= 80 else name[:77] + "...").replace("|", "/")
        total = sum(durs)
        lines.append(f"| `{short}` | {len(durs)} | {total / 1e3:.1f} | {total / len(durs):.1f} |")
    return [*lines, ""]


def self_times(ops: list[dict]) -> dict[str, list[float]]:
    """Each op's own host time: its span less its nested ops' (per thread)."""
    out: dict[str, list[float]] = defaultdict(list)
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in ops:
        by_tid[e.get("tid")].append(e)
    for seq in by_tid.values():
        seq.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, own]
        for e in seq:
            while stack and stack[-1][0] <= e["ts"]:
                _, name, own = stack.pop()
                out[name].append(own)
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], e["dur"]])
        for _, name, own in stack:
            out[name].append(own)
    return out


SOURCES = ("megatron_grpo/", "megatron/core/")  # the frames an op is charged to


def by_source(events: list[dict], spans: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Each outermost aten op's host time (inside ``spans``) under the innermost Python frame
    from :data:`SOURCES` open when it started, per thread; empty without stacks."""
    out: dict[str, list[float]] = defaultdict(list)
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("python_function", "cpu_op"):
            by_tid[e.get("tid")].append(e)
    for seq in by_tid.values():
        seq.sort(key=lambda e: (e["ts"], -e["dur"]))
        frames: list[tuple[float, str]] = []  # open project frames: (end, short name)
        op_end = float("-inf")  # the open outermost op's end
        for e in seq:
            while frames and frames[-1][0] <= e["ts"]:
                frames.pop()
            if e["cat"] == "python_function":
                short = _short(e["name"])
                if short:
                    frames.append((e["ts"] + e["dur"], short))
            elif e["ts"] >= op_end and frames and inside(e, spans):
                out[frames[-1][1]].append(e["dur"])
                op_end = e["ts"] + e["dur"]
    return out


def _short(frame: str) -> str:
    """``.../megatron_grpo/x.py(12): f`` -> ``megatron_grpo/x.py(12): f``; "" for others."""
    cut = max(frame.rfind(src) for src in SOURCES)
    return frame[cut:] if cut >= 0 else ""


def summarize(events: list[dict], stage: str, top: int) -> str:
    spans = stage_spans(events, stage)
    span_ms = sum(b - a for a, b in spans) / 1e3
    ops: list[dict] = []  # the stage's aten ops
    by_cat: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if inside(e, spans):
            by_cat[e.get("cat", "")][e["name"]].append(e["dur"])
            if e.get("cat") == "cpu_op":
                ops.append(e)
    runtime = by_cat["cuda_runtime"]
    launches = sum(len(v) for k, v in runtime.items() if "Launch" in k)
    syncs = {k: v for k, v in runtime.items() if "Synchronize" in k or "Memcpy" in k}
    kernels = by_cat["kernel"]
    kernel_ms = sum(sum(v) for v in kernels.values()) / 1e3
    lines = [
        f"# stage/{stage}: {len(spans)} range(s), {span_ms:.1f} ms",
        "",
        f"kernels: {sum(len(v) for v in kernels.values())} ({kernel_ms:.1f} ms of kernel time); "
        f"launch calls: {launches}; host syncs and copies: "
        f"{sum(len(v) for v in syncs.values())} ({sum(sum(v) for v in syncs.values()) / 1e3:.1f}"
        " ms waiting in them)",
        "",
    ]
    lines += table("aten ops (self host time)", self_times(ops), top)
    lines += table("aten ops (inclusive host time)", by_cat["cpu_op"], top)
    sources = by_source(events, spans)
    if sources:
        lines += table("aten ops' host time by the calling source line", sources, top)
    lines += table("CUDA runtime calls", runtime, top)
    lines += table("kernels", kernels, top)
    lines += table("annotations", by_cat["user_annotation"], top)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a profile's rank<R>_steps<a>-<b>.json.gz")
    p.add_argument("--stage", default="update", help="the stage range (stage/<name>)")
    p.add_argument("--top", type=int, default=25, help="rows per table")
    args = p.parse_args()
    print(summarize(load(args.trace), args.stage, args.top))


if __name__ == "__main__":
    main()
