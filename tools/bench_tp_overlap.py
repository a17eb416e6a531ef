"""The overlapped TP linear layers (``model.layer_kernels.tp_overlap``: ``ring`` and ``symm``)
against megatron-core's (``off``) at TP = the torchrun world size with sequence parallelism
(issue 42).

One decoder layer's four TP linears of a model shape (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``: column, row, column, row), chained as in the layer, in bf16:
the no-grad forward (the log-prob pass) and forward + backward (training), ms per layer, for
each choice built with the same weights (``--choices``), each kind's largest deviation from
``off`` (relative to the output's scale) and, on GPUs, the fwd+bwd passes' peak memory. Writes
``OUT/bench_tp_overlap_tpN.json``.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 CUDA_DEVICE_MAX_CONNECTIONS=1 \\
      python -m torch.distributed.run --standalone --nproc-per-node 4 \\
      tools/bench_tp_overlap.py --tokens 8192,32768 --out gpu_out/tp_overlap
    python -m torch.distributed.run --nproc-per-node 2 tools/bench_tp_overlap.py --device cpu \\
      --tokens 16 --hidden 32 --ffn 64 --qkv 48 --proj 32 --iters 1 --out out   # dry run (gloo)

Defaults: the Qwen3-8B layer (hidden 4096, ffn 12288 (SwiGLU: fc1 out 2 x ffn), q+k+v 6144,
attention output 4096).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402

from megatron_grpo.megatron import ParallelConfig, initialize_parallel  # noqa: E402
from megatron_grpo.megatron.model.tp_overlap import tp_linear_classes  # noqa: E402

CHOICES = ("off", "ring", "symm")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", default="8192", help="comma list of sequence lengths (all ranks)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=12288)
    p.add_argument("--qkv", type=int, default=6144, help="q + k + v output features")
    p.add_argument("--proj", type=int, default=4096, help="attention output features (heads x d)")
    p.add_argument("--choices", default=",".join(CHOICES[1:]), help="kinds to time next to off")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("gpu_out/tp_overlap"))
    return p.parse_args(argv)


def _layers(choice: str, a: argparse.Namespace, tp: int, dtype, device) -> list:
    """The four linears of a layer built as ``choice`` builds them, seeded weights."""
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True,
                              use_cpu_initialization=device.type == "cpu",
                              perform_initialization=False, params_dtype=dtype)  # fmt: skip
    column, row = tp_linear_classes(choice, cfg)
    common = dict(config=cfg, init_method=lambda w: None, bias=False, skip_bias_add=True)
    layers = [column(a.hidden, a.qkv, gather_output=False, **common),
              row(a.proj, a.hidden, input_is_parallel=True, **common),
              column(a.hidden, 2 * a.ffn, gather_output=False, **common),
              row(a.ffn, a.hidden, input_is_parallel=True, **common)]  # fmt: skip
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    for layer in layers:
        w = torch.randn(layer.weight.shape, generator=g) / layer.weight.shape[1] ** 0.5
        with torch.no_grad():
            layer.weight.copy_(w.to(device, dtype))
    return layers


def _forward(layers: list, x: torch.Tensor) -> torch.Tensor:
    """qkv -> proj (+ residual), fc1 -> SwiGLU -> fc2 (+ residual): the layer's chain (the
    attention itself left out: q's first features stand in for its output)."""
    q, _ = layers[0](x)
    h = x + layers[1](q[..., : layers[1].input_size_per_partition])[0]
    f, _ = layers[2](h)
    gate, up = f.chunk(2, dim=-1)
    return h + layers[3](torch.nn.functional.silu(gate) * up)[0]


def _time(fn, a: argparse.Namespace, device) -> float:
    """ms per call (median of ``iters``)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(a.warmup):
        fn()
    times = []
    for _ in range(a.iters):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _row(a, tokens: int, tp: int, dtype, device) -> dict:
    """Every choice at ``tokens``: ms of the no-grad forward and of forward + backward."""
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    x = torch.randn(tokens // tp, 1, a.hidden, generator=g).to(device, dtype)
    row, outs = dict(tokens=tokens), {}
    for choice in _choices(a):
        layers = _layers(choice, a, tp, dtype, device)
        with torch.no_grad():
            outs[choice] = _forward(layers, x).float()
            logprob = _time(lambda: _forward(layers, x), a, device)  # noqa: B023

        def train(layers=layers):
            xg = x.detach().requires_grad_(True)
            _forward(layers, xg).sum().backward()

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row[choice] = dict(logprob_ms=logprob, train_ms=_time(train, a, device))
        if device.type == "cuda":  # the timed fwd+bwd passes' peak (weights and inputs included)
            row[choice]["train_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    scale = outs["off"].abs().max().item() + 1e-12
    for kind in _choices(a)[1:]:
        row[f"{kind}_vs_off"] = (outs[kind] - outs["off"]).abs().max().item() / scale
        for p in ("logprob_ms", "train_ms"):
            row[f"speedup_{kind}_{p[:-3]}"] = row["off"][p] / row[kind][p]
    return row


def _choices(a) -> list[str]:
    kinds = [c for c in a.choices.split(",") if c]
    bad = [c for c in kinds if c not in CHOICES[1:]]
    if bad:
        raise SystemExit(f"--choices: {bad} not among {CHOICES[1:]}")
    return ["off", *kinds]


def main(argv=None) -> int:
    a = _args(argv)
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    tp = int(os.environ.get("WORLD_SIZE", 1))
    initialize_parallel(ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1), 1)
    device = torch.device(a.device, torch.cuda.current_device()) if a.device == "cuda" else None
    device = device or torch.device("cpu")
    dtype = torch.bfloat16
    rows = [_row(a, int(t), tp, dtype, device) for t in a.tokens.split(",")]
    if dist.get_rank() == 0:
        print(f"TP {tp} + SP, bf16, layer hidden={a.hidden} ffn={a.ffn} qkv={a.qkv}")
        print(f"{'tokens':>8} {'choice':>6} {'fwd ms':>9} {'f+b ms':>9} {'x fwd':>6} {'x f+b':>6} "
              f"{'dev':>8} {'f+b GiB':>8}")  # fmt: skip
        for r in rows:
            for c in _choices(a):
                t, x = r[c], ("-", "-", "-") if c == "off" else (
                    f"{r[f'speedup_{c}_logprob']:.2f}", f"{r[f'speedup_{c}_train']:.2f}",
                    f"{r[f'{c}_vs_off']:.1e}")  # fmt: skip
                peak = f"{t['train_peak_gib']:.2f}" if "train_peak_gib" in t else "-"
                print(f"{r['tokens']:>8} {c:>6} {t['logprob_ms']:>9.3f} {t['train_ms']:>9.3f} "
                      f"{x[0]:>6} {x[1]:>6} {x[2]:>8} {peak:>8}")  # fmt: skip
        a.out.mkdir(parents=True, exist_ok=True)
        path = a.out / f"bench_tp_overlap_tp{tp}.json"
        path.write_text(json.dumps(dict(tp=tp, args={k: str(v) for k, v in vars(a).items()},
                                        device=str(device), rows=rows), indent=1))  # fmt: skip
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
