"""``tools/trace_stage.py``: one trainer stage's host time from a profile's Chrome trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import trace_stage  # noqa: E402


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _trace() -> list[dict]:
    """stage/update over [100, 200): an op of 40 us holding one of 10 and one of 5 (own time 25),
    a launch, a sync; outside it an op and a kernel that must not count."""
    return [
        _x("stage/logprob", "user_annotation", 0, 100),
        _x("aten::outside", "cpu_op", 10, 50),
        _x("kernel_outside", "kernel", 20, 30),
        _x("stage/update", "user_annotation", 100, 100),
        _x("aten::outer", "cpu_op", 110, 40),
        _x("aten::inner", "cpu_op", 115, 10),
        _x("aten::inner", "cpu_op", 130, 5),
        _x("aten::other_thread", "cpu_op", 112, 7, tid=2),
        _x("cudaLaunchKernel", "cuda_runtime", 116, 2),
        _x("cudaStreamSynchronize", "cuda_runtime", 160, 30),
        _x("gemm_kernel", "kernel", 150, 20),
        {"ph": "i", "name": "instant", "ts": 120},  # no duration: skipped
    ]


def test_own_times_subtract_nested_ops_per_thread():
    ops = [e for e in _trace() if e.get("cat") == "cpu_op" and 100 <= e["ts"] < 200]
    own = trace_stage.self_times(ops)
    assert own == {"aten::outer": [25], "aten::inner": [10, 5], "aten::other_thread": [7]}


def test_summary_counts_only_the_stage(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    text = trace_stage.summarize(trace_stage.load(path), "update", top=10)
    assert text.startswith("# stage/update: 1 range(s), 0.1 ms")
    assert "kernels: 1 (0.0 ms of kernel time); launch calls: 1; host syncs and copies: 1" in text
    assert "| `aten::outer` | 1 | 0.0 | 25.0 |" in text  # own time, then inclusive below
    assert "| `aten::outer` | 1 | 0.0 | 40.0 |" in text
    assert "| `aten::inner` | 2 | 0.0 | 7.5 |" in text
    assert "outside" not in text
    with pytest.raises(SystemExit, match="no range 'stage/rollout'.*stage/logprob, stage/update"):
        trace_stage.summarize(trace_stage.load(path), "rollout", top=10)


def test_a_real_profiler_trace(tmp_path):
    """torch.profiler's own export (CPU): the stage's matmuls are found, with their count."""
    from torch.profiler import ProfilerActivity, profile, record_function

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(a, a)  # outside the stage
        with record_function("stage/update"):
            for _ in range(3):
                torch.mm(a, a)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    text = trace_stage.summarize(trace_stage.load(path), "update", top=5)
    assert "| `aten::mm` | 3 |" in text, text
    assert "calling source line" not in text  # recorded without Python stacks


def test_ops_charged_to_the_calling_source_line(tmp_path):
    """With Python stacks, an op is charged to the innermost megatron_grpo frame that called it
    (here ``loss.math.true_positions``), once per call; ops outside the stage are not."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from megatron_grpo.loss.math import true_positions

    mask = torch.tensor([True, False, True, True])
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        true_positions(mask, 3)  # outside the stage
        with record_function("stage/update"):
            for _ in range(2):
                true_positions(mask, 3)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = trace_stage.load(path)
    found = trace_stage.by_source(events, trace_stage.stage_spans(events, "update"))
    lines = [k for k in found if k.startswith("megatron_grpo/loss/math.py(")]
    assert lines and all(k.endswith(": true_positions") for k in lines), dict(found)
    # its three ops (arange, cumsum, searchsorted) per call, two calls
    assert sum(len(found[k]) for k in lines) == 6, dict(found)
