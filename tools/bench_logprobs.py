"""Benchmark: per-token log-probs through the LM head, forward + backward, against peers.

One GPU (T=8192 and 32768, H=4096, V=151936, bf16; a table on stdout, JSON under --out)::

    python tools/bench_logprobs.py
    torchrun --nproc-per-node 4 tools/bench_logprobs.py --tp     # per-GPU time vs TP=1 time / TP
    torchrun --nproc-per-node 4 tools/bench_logprobs.py --tp --main-grad  # Megatron's fp32 buffer

CPU dry run of the same logic at tiny sizes (Triton kernels in the interpreter)::

    python tools/bench_logprobs.py --device cpu --tiny   # (tests/test_tools.py runs it)
    torchrun --nproc-per-node 2 tools/bench_logprobs.py --tp --device cpu --tiny

Every method runs forward + backward of an objective: sum(c * logp) for the log-prob methods,
sum(c * logp + u * entropy) for the entropy variants, the GRPO loss for the GRPO methods, the
GSPO loss (``ratio_level="sequence"``; fused: the plan's path) for fused_gspo / unfused_gspo. The
fp32 reference is the fp32 GEMM of the same bf16 inputs (TF32 off), chunked, with autograd.
Peak extra memory = max_memory_allocated during one step minus what was allocated before it
(inputs, no gradients), so it includes the gradients themselves ("over_grads" subtracts them).
Which gradients: by default d hidden and d weight in the input dtype (``h.grad``, ``w.grad``,
bf16: what autograd hands back). With ``--main-grad`` the weight carries an fp32 ``main_grad``
allocated before the step, as Megatron's DDP grad buffer (d weight lands there, no ``w.grad``):
the counted gradient is then ``h.grad`` only, main_grad being part of the baseline; only our
methods support it (the peers are skipped).

Each of our methods prints the LM-head plan it ran with (``megatron_grpo/ops/lm_head/plan.py``: path,
kernels, tiles or single-pass chunks, backward loop order, d_weight mode, memory budget; a short
label in the tables). fused_grpo's token-ratio path is the plan's choice (single pass when a
full-width chunk of >= 1024 rows fits the budget, ``ops.lm_head.plan``); ``--fused-path``
names one (``fused_single_pass`` / ``fused_tiled``) to measure both at one size (fused_gspo
ignores it: its plan's path, "fused_tiled"), and ``--memory-budget-gib`` sets the plan's memory
budget (default 1 GiB: 256 MiB tiles).

Timing: the median of ``--reps`` steps after ``--warmup``, gradient buffers zeroed before each
step outside the timed region. "x floor" is a method's time over the cuBLAS 3-GEMM floor timed
right before and right after it (single-GPU runs): the GPU's clock drifts under sustained load
by several percent within a run, more than the differences measured here.

This file is the harness (CLI, problems, the fp32 reference, measurement); the methods, the GEMM
floor and the GEMM options are in ``tools/bench_methods.py``, the targets, the tables and the JSON
in ``tools/bench_report.py``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from datetime import timedelta
from pathlib import Path

SINGLE = ["floor", "torch", "triton", "torch_entropy", "triton_entropy", "fused_grpo",
          "unfused_grpo", "fused_gspo", "unfused_gspo", "megatron_fused_ce", "cce_exact",
          "cce"]  # fmt: skip
PEERS = ("megatron_fused_ce", "cce_exact", "cce")
TP_METHODS = ["floor", "triton", "triton_sp", "fused_grpo", "fused_grpo_sp", "megatron_fused_ce"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=None, help="tokens (default 8192 32768)")
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936, help="padded vocab (rows of the weight)")
    ap.add_argument("--vocab-size", type=int, default=None, help="real vocab (default V)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="T=96 160, H=64, V=1000, vocab 997 (fused: the single pass in 64-row chunks)",
    )
    ap.add_argument("--tp", action="store_true", help="tensor-parallel mode (under torchrun)")
    ap.add_argument("--methods", nargs="+", default=None, help="subset of the methods")
    ap.add_argument("--chunk-size", type=int, default=None, help="rows per chunk of our op")
    ap.add_argument(
        "--fused-path",
        choices=["fused_single_pass", "fused_tiled", "op"],
        default=None,
        help="fused_grpo_loss's path= (default: the plan's choice)",
    )
    ap.add_argument(
        "--memory-budget-gib",
        type=float,
        default=None,
        help="the LM-head plan's memory budget in GiB (default 1: 256 MiB logits tiles)",
    )
    ap.add_argument("--gemm-rows", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024, help="GRPO sequence length")
    ap.add_argument(
        "--main-grad",
        action="store_true",
        help="fp32 weight.main_grad allocated up front (Megatron DDP buffer)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    a = ap.parse_args(argv)
    if a.tiny:
        a.T, a.H, a.V = a.T or [96, 160], 64, 1000
        a.vocab_size = a.vocab_size or 997
        a.chunk_size, a.gemm_rows, a.seq_len, a.reps, a.warmup = a.chunk_size or 64, [32], 32, 2, 1
        a.fused_path = a.fused_path or "fused_single_pass"
    a.T = a.T or [8192, 32768]
    a.vocab_size = a.vocab_size or a.V
    gib = a.memory_budget_gib
    a.memory_budget = None if gib is None else int(gib * 2**30)
    return a


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    # Triton builds its library for the interpreter only if this is set before its first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_methods import (  # noqa: E402
    LOSSES,
    METHODS,
    SOLO_GROUP,
    Problem,
    clear_grads,
    floor_ms,
    fp32_highest,
    gemm_options,
    median_ms,
    method_plan,
    plan_label,
    rel_err,
    sync,
    weight_grad,
)
from bench_report import (  # noqa: E402
    annotate,
    print_row,
    print_summary,
    print_tp,
    run_info,
    write_single,
    write_tp,
)

from megatron_grpo.loss import grpo_loss  # noqa: E402
from megatron_grpo.ops import vocab_parallel_logprobs  # noqa: E402

# ----------------------------------------------------------------------------- objectives


def grpo_grads(p: Problem, logp: torch.Tensor, loss_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d logp) of the loss ``LOSSES[loss_name]`` at `logp` ([T] fp32)."""
    with torch.enable_grad():
        lp = logp.detach().float().requires_grad_()
        loss, _ = grpo_loss(LOSSES[loss_name], logprobs=lp, **p.grpo)
        return loss.detach(), torch.autograd.grad(loss, lp)[0]


def ref_forward(p: Problem, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32-GEMM reference log-probs and entropies [T] (no grad)."""
    h32, w32 = p.h.detach().float(), p.w.detach().float()
    logp, ent = [], []
    with fp32_highest(), torch.no_grad():
        for i in range(0, h32.size(0), chunk):
            lp, en = _ref_chunk(h32[i : i + chunk], w32, p.targets[i : i + chunk], p.vocab_size)
            logp.append(lp)
            ent.append(en)
    return torch.cat(logp), torch.cat(ent)


def reference(p: Problem, objective: str, logp: torch.Tensor, ent: torch.Tensor, chunk: int):
    """The objective's value and its fp32 d h, d w (recomputed chunk by chunk with autograd)."""
    g_ent = p.ent_coef if objective == "logp_entropy" else None
    if objective in LOSSES:
        value, g_logp = grpo_grads(p, logp, objective)
    else:
        g_logp = p.coef
        value = (p.coef * logp).sum() + ((g_ent * ent).sum() if g_ent is not None else 0.0)
    h32, w32 = p.h.detach().float(), p.w.detach().float().requires_grad_()
    dh = torch.empty_like(h32)
    with fp32_highest(), torch.enable_grad():
        for i in range(0, h32.size(0), chunk):
            hc = h32[i : i + chunk].clone().requires_grad_()
            lp, en = _ref_chunk(hc, w32, p.targets[i : i + chunk], p.vocab_size)
            outs, grads = [lp], [g_logp[i : i + chunk]]
            if g_ent is not None:
                outs, grads = [lp, en], [g_logp[i : i + chunk], g_ent[i : i + chunk]]
            torch.autograd.backward(outs, grads)
            dh[i : i + chunk] = hc.grad
    return dict(logp=logp, ent=ent, value=float(value), dh=dh, dw=w32.grad)


def _ref_chunk(h, w, targets, vocab_size):
    lsm = torch.log_softmax((h @ w.t())[:, :vocab_size], dim=-1)
    return lsm.gather(1, targets[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)


def run_method(
    name: str, p: Problem, ref: dict | None, args, dev, keep: bool = False, floor_fn=None
) -> dict:
    """Time, peak memory and (vs `ref`) errors of one method; errors are recorded, not raised.

    keep: also return the first step's (logp, d h, d w) under "_out". floor_fn: times the floor
    right before and right after the method; their mean is its ``floor_ms`` (a long run's GPU
    clock drifts by several percent, so each ratio uses the floor of its own minute).
    """
    step = METHODS[name][0]
    res: dict = {}
    try:
        plan = method_plan(name, p)
        if plan is not None:
            res["path"], res["plan"] = plan_label(plan), str(plan)
        clear_grads(p)
        logp, ent, value = step(p)  # also the warm-up / compile run
        sync(dev)
        grads = [t.grad for t in (p.h, p.w) if t.grad is not None]
        res["grad_gib"] = sum(g.numel() * g.element_size() for g in grads) / 2**30
        if ref is not None:
            res.update(_errors(p, ref, logp, ent, value))
        if keep:
            res["_out"] = (logp, p.h.grad, weight_grad(p).clone())
        clear_grads(p)
        if dev.type == "cuda":
            res["peak_extra_gib"] = _peak_extra_gib(step, p, dev)
            res["over_grads_gib"] = res["peak_extra_gib"] - res["grad_gib"]
        before = None if floor_fn is None else floor_fn()
        res["ms"] = median_ms(
            lambda: step(p), dev, args.warmup, args.reps, setup=lambda: clear_grads(p)
        )
        if before is not None:
            res["floor_ms"] = (before + floor_fn()) / 2
    except Exception as e:  # noqa: BLE001 - a failing peer must not stop the benchmark
        res = {"error": f"{type(e).__name__}: {e}"[:400]}
    clear_grads(p)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _errors(p: Problem, ref: dict, logp, ent, value) -> dict:
    """A method's first step against the fp32 reference ``ref``."""
    out = {"logp_max_abs": (logp - ref["logp"]).abs().max().item()}
    if ent is not None:
        out["ent_max_abs"] = (ent - ref["ent"]).abs().max().item()
    out["value_rel"] = abs(value.item() - ref["value"]) / max(abs(ref["value"]), 1e-30)
    out["dh_rel"] = rel_err(p.h.grad, ref["dh"])
    out["dw_rel"] = rel_err(weight_grad(p), ref["dw"])
    return out


def _peak_extra_gib(step, p: Problem, dev) -> float:
    """Peak memory of one step beyond what was allocated before it, in GiB."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(p)
    sync(dev)
    return (torch.cuda.max_memory_allocated() - base) / 2**30


# ----------------------------------------------------------------------------- problems


def make_problem(T: int, args, dev: torch.device, seed: int = 0) -> Problem:
    """Same seed -> the same tensors on every rank (the TP mode shards them)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    dt = torch.bfloat16

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=dev) * scale

    h = randn(T, args.H, scale=0.5).to(dt).requires_grad_()
    w = randn(args.V, args.H, scale=0.02).to(dt).requires_grad_()
    targets = torch.randint(0, args.vocab_size, (T,), generator=g, device=dev)
    if getattr(args, "main_grad", False):
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=dev)
    return Problem(h, w, targets, randn(T), randn(T, scale=0.1), args.vocab_size,
                   chunk_size=args.chunk_size, memory_budget=args.memory_budget,
                   fused_path=args.fused_path)  # fmt: skip


def make_grpo(logp: torch.Tensor, seq_len: int, seed: int = 1) -> dict:
    """GRPO inputs near on-policy (old = logp + noise), one advantage per sequence."""
    T, dev = logp.numel(), logp.device
    g = torch.Generator(device=dev).manual_seed(seed)
    starts = list(range(0, T, seq_len))
    cu = torch.tensor(starts + [T], device=dev)
    adv = torch.randn(len(starts), generator=g, device=dev).repeat_interleave(cu.diff())
    old = logp.detach().float() + 0.05 * torch.randn(T, generator=g, device=dev)
    mask = torch.ones(T, dtype=torch.bool, device=dev)
    return dict(old_logprobs=old, advantages=adv, loss_mask=mask, cu_seqlens=cu)


# ----------------------------------------------------------------------------- single GPU


def run_single(args, dev, methods: list[str]) -> dict:
    ref_chunk = min(1024, max(args.T))
    results: dict = {}
    for T in args.T:
        p = make_problem(T, args, dev)
        res = results[str(T)] = {}
        logp_ref, ent_ref = ref_forward(p, ref_chunk)
        p.grpo = make_grpo(logp_ref, args.seq_len)
        floor_fn = None
        if "floor" in methods:
            res["floor"] = floor_ms(p.h, p.w, args, dev)
            print_row(T, "floor", res["floor"], None)
            if dev.type == "cuda":
                floor_fn = functools.partial(_floor_probe, p, args, dev)
        for objective in ("logp", "logp_entropy", *LOSSES):
            names = [m for m in methods if m in METHODS and METHODS[m][1] == objective]
            if not names:
                continue
            ref = reference(p, objective, logp_ref, ent_ref, ref_chunk)
            for name in names:
                res[name] = run_method(name, p, ref, args, dev, floor_fn=floor_fn)
                print_row(T, name, res[name], res.get("floor"))
            del ref
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if "gemm_options" in methods:
            res["gemm_options"] = gemm_options(p, args, dev)
        del p, logp_ref, ent_ref
    annotate(results)
    return results


def _floor_probe(p: Problem, args, dev) -> float:
    """The floor's ms now (3 timed reps after 1 warm-up)."""
    return floor_ms(p.h, p.w, argparse.Namespace(reps=3, warmup=1), dev)["ms"]


# ----------------------------------------------------------------------------- tensor parallel


def _tp_pair(name: str, full: Problem, shard, group, args, dev) -> tuple[dict, dict]:
    """`name` at TP=1 on this GPU (full vocab), then at TP=N on this rank's shard, compared."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sp = name.endswith("_sp")
    h = full.h.detach().chunk(world)[rank] if sp else full.h.detach()
    tp = Problem(h.clone().requires_grad_(), shard, full.targets, full.coef, full.ent_coef,
                 full.vocab_size, full.grpo, group, sp, full.chunk_size, full.memory_budget,
                 full.fused_path)  # fmt: skip
    r1 = run_method(name, full, None, args, dev, keep=True)
    rn = run_method(name, tp, None, args, dev, keep=True)
    if "_out" in r1 and "_out" in rn:
        (lp1, dh1, dw1), (lpn, dhn, dwn) = r1["_out"], rn["_out"]
        dh1 = dh1.chunk(world)[rank] if sp else dh1
        rn["logp_vs_tp1"] = (lpn - lp1).abs().max().item()
        rn["dh_vs_tp1"], rn["dw_vs_tp1"] = rel_err(dhn, dh1), rel_err(dwn, dw1.chunk(world)[rank])
    r1.pop("_out", None)  # tensors stay out of the gathered rows
    rn.pop("_out", None)
    return r1, rn


def run_tp(args, dev, methods: list[str]) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    if args.V % world or any(T % world for T in args.T):
        raise SystemExit(f"--V and --T must be divisible by the TP size {world}")
    rows = []
    for T in args.T:
        full = make_problem(T, args, dev)
        with torch.no_grad():
            logp0 = vocab_parallel_logprobs(
                full.h, full.w, full.targets, vocab_size=args.vocab_size,
                chunk_size=args.chunk_size, memory_budget=args.memory_budget,
            )  # fmt: skip
        full.grpo = make_grpo(logp0, args.seq_len)
        shard = full.w.detach().chunk(world)[rank].clone().requires_grad_()
        if args.main_grad:
            shard.main_grad = torch.zeros(shard.shape, dtype=torch.float32, device=dev)
        for name in methods:
            if name == "floor":
                r1, rn = floor_ms(full.h, full.w, args, dev), floor_ms(full.h, shard, args, dev)
            else:
                r1, rn = _tp_pair(name, full, shard, group, args, dev)
            row = {"T": T, "tp": world, "rank": rank, "method": name, "tp1": r1, "tpn": rn}
            if "ms" in r1 and "ms" in rn:
                row["efficiency"] = r1["ms"] / world / rn["ms"]
            rows.append(row)
        del full, shard
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    return [r for rank_rows in gathered for r in rank_rows]


# ----------------------------------------------------------------------------- main


def _methods(args) -> list[str]:
    """The methods to run: ``--methods`` checked, or the defaults; peers dropped under
    ``--main-grad``."""
    methods = args.methods or (TP_METHODS if args.tp else SINGLE + ["gemm_options"])
    unknown = set(methods) - set(METHODS) - {"floor", "gemm_options"}
    if unknown:
        raise SystemExit(f"unknown --methods {sorted(unknown)}; known: {sorted(METHODS)}")
    if args.main_grad:
        peers = [m for m in methods if m in PEERS]
        if peers:
            print(f"--main-grad: skipping {peers} (they write w.grad, not main_grad)")
        methods = [m for m in methods if m not in PEERS]
    return methods


def _init_distributed(args, dev) -> None:
    """torchrun's group with --tp, else a one-rank group (the ops take a TP group)."""
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if args.tp:  # torchrun sets the rendezvous variables
        if dev.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(minutes=5))
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group(backend, rank=0, world_size=1)


def main() -> int:
    args = ARGS or parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny for a dry run", file=sys.stderr)
        return 2
    methods = _methods(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _init_distributed(args, dev)
    world, rank = dist.get_world_size(), dist.get_rank()
    SOLO_GROUP.append([dist.new_group([r]) for r in range(world)][rank])
    info = run_info(args, dev)
    tag = "-".join(map(str, args.T)) + ("_main_grad" if args.main_grad else "")
    if args.tp:
        rows = run_tp(args, dev, methods)
        if rank == 0:
            print_tp(rows)
            write_tp(out / f"bench_tp{world}_T{tag}.json", info, rows)
    else:
        results = run_single(args, dev, methods)
        print_summary(results, args.main_grad)
        write_single(out / f"bench_single_T{tag}.json", info, results)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
