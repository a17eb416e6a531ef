"""Benchmark: the trainer's non-finite gradient check (``train/nonfinite._grads_bad``), per
parameter against per gradient buffer, on one device.

A chunk of ``--params`` parameters of ``--elements`` fp32 gradient elements in all (sizes drawn
log-uniformly, as a model's mix of norms, projections and experts), their ``main_grad`` s views
into one contiguous buffer as megatron-core's DDP lays them out. The same function runs twice:
on the chunk without the buffer (each ``main_grad`` checked: the path before) and with it (the
buffer checked in pieces). Wall time per check, host sync included (the check ends in one)::

    python tools/bench_nonfinite.py --params 225 --elements 60000000
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from megatron_grpo.train.nonfinite import _grads_bad


def _chunks(params: int, elements: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    weights = torch.exp(torch.rand(params, generator=g) * 10)
    sizes = (weights / weights.sum() * elements).long().clamp(min=1).tolist()
    buffer = torch.zeros(sum(sizes), device=device)
    plain = torch.nn.Module()
    for i, view in enumerate(buffer.split(sizes)):
        p = torch.nn.Parameter(torch.empty(0, device=device))
        p.main_grad = view
        plain.register_parameter(f"p{i}", p)
    ddp = torch.nn.Module()
    ddp.inner = plain
    ddp.buffers = [SimpleNamespace(grad_data=buffer)]
    ddp.expert_parallel_buffers = []
    return plain, ddp, len(sizes)


def _time(chunk, iters: int) -> float:
    for _ in range(3):
        _grads_bad([chunk])
    t0 = time.perf_counter()
    for _ in range(iters):
        assert not _grads_bad([chunk])
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=225)
    ap.add_argument("--elements", type=float, default=6e7)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    plain, ddp, n = _chunks(a.params, int(a.elements), torch.device(a.device))
    per_param, per_buffer = _time(plain, a.iters), _time(ddp, a.iters)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"{name}: {n} parameters, {int(a.elements):,} elements: per parameter "
          f"{per_param:.2f} ms, per buffer {per_buffer:.2f} ms ({per_param / per_buffer:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
