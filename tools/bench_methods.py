"""The methods of tools/bench_logprobs.py: ours (the log-prob op, the fused GRPO / GSPO loss), the
peers (Megatron's fused cross entropy, Apple's Cut Cross-Entropy), the 3-GEMM floor and the
GEMM options, plus the problem they run on and the timer they share.

A method's step runs forward + backward on a :class:`Problem` and returns
``(logp, entropy | None, objective value)``. Imported by the harness after it has set
``TRITON_INTERPRET`` for CPU runs (Triton reads it at its first import).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from megatron_grpo.loss import GRPOLossConfig, grpo_loss
from megatron_grpo.ops import (
    LMHeadPlan,
    fused_grpo_loss,
    fused_grpo_loss_plan,
    logprobs_plan,
    vocab_parallel_logprobs,
)


@dataclass
class Problem:
    """One workload: leaves h [T_local, H] and w [V_local, H] with grads, objective weights."""

    h: torch.Tensor
    w: torch.Tensor
    targets: torch.Tensor  # [T] global ids
    coef: torch.Tensor  # [T] fp32 weight of logp in the objective
    ent_coef: torch.Tensor  # [T] fp32 weight of the entropy
    vocab_size: int
    grpo: dict = field(default_factory=dict)  # grpo_loss inputs (old_logprobs, ...)
    group: object = None  # TP group (None = no TP)
    sp: bool = False
    chunk_size: int | None = None
    memory_budget: int | None = None  # bytes of the LM head's working set (ops.lm_head.plan)
    fused_path: str | None = None  # fused_grpo_loss's path= (None: the plan's choice)

    def op_args(self) -> dict:
        """The LM-head arguments every one of our methods passes."""
        return dict(tp_group=self.group, sequence_parallel=self.sp, vocab_size=self.vocab_size,
                    chunk_size=self.chunk_size, memory_budget=self.memory_budget)  # fmt: skip


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def median_ms(
    fn: Callable[[], object], dev: torch.device, warmup: int, reps: int,
    setup: Callable[[], object] | None = None,
) -> float:  # fmt: skip
    """Median ms of ``fn()``; ``setup()`` (e.g. zeroing gradient buffers, a step's business,
    not the LM head's) runs before each call, outside the timed region."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        sync(dev)
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


@contextmanager
def fp32_highest():
    """True fp32 GEMMs (no TF32) for the reference only; the user's setting is restored."""
    prec, tf32 = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prec)
        torch.backends.cuda.matmul.allow_tf32 = tf32


# ----------------------------------------------------------------------------- methods
# A step runs forward + backward and returns (logp, entropy | None, objective value).


def _ours(impl: str, entropy: bool, gemm: str = "auto"):
    def step(p: Problem):
        out = vocab_parallel_logprobs(
            p.h, p.w, p.targets, return_entropy=entropy, impl=impl, gemm=gemm, **p.op_args()
        )
        logp, ent = out if entropy else (out, None)
        obj = (p.coef * logp).sum() + ((p.ent_coef * ent).sum() if entropy else 0.0)
        obj.backward()
        return logp.detach(), None if ent is None else ent.detach(), obj.detach()

    return step


# The loss objectives: name -> config (GSPO: sequence ratio, the rest default).
LOSSES = {"grpo": GRPOLossConfig(), "gspo": GRPOLossConfig(ratio_level="sequence")}

# fused_grpo_loss variants: name -> (path override or None = --fused-path / the plan's, gemm,
# loss). GSPO: "fused" = the plan's path whatever --fused-path says (the single pass refuses it).
_FUSED = {
    "fused_grpo": (None, "auto", "grpo"),
    "fused_grpo_sp": (None, "auto", "grpo"),
    "fused_grpo_tiled": ("fused_tiled", "auto", "grpo"),
    "fused_grpo_separate": (None, "separate", "grpo"),
    "fused_gspo": ("fused", "auto", "gspo"),
}
# vocab_parallel_logprobs + grpo_loss: name -> loss
_UNFUSED = {"unfused_grpo": "grpo", "unfused_gspo": "gspo"}


def _fused_args(name: str, p: Problem) -> dict:
    path, gemm, _ = _FUSED[name]
    return dict(**p.grpo, impl="auto", path=path or p.fused_path, gemm=gemm, **p.op_args())


def _fused_grpo(name: str):
    cfg = LOSSES[_FUSED[name][2]]

    def step(p: Problem):
        loss, _, logp = fused_grpo_loss(p.h, p.w, p.targets, cfg, **_fused_args(name, p))
        loss.backward()
        return logp.detach(), None, loss.detach()

    return step


def method_plan(name: str, p: Problem) -> LMHeadPlan | None:
    """The LM-head plan method ``name`` runs on this problem (None: a peer or the floor)."""
    if name in _FUSED:
        cfg = LOSSES[_FUSED[name][2]]
        return fused_grpo_loss_plan(p.h, p.w, p.targets, cfg, **_fused_args(name, p))
    if name in _UNFUSED:
        return logprobs_plan(p.h, p.w, p.targets, rows=p.grpo["loss_mask"], impl="auto",
                             **p.op_args())  # fmt: skip
    if name.split("_")[0] in ("torch", "triton"):
        gemm = "separate" if name.endswith("_separate") else "auto"
        return logprobs_plan(p.h, p.w, p.targets, impl=name.split("_")[0], gemm=gemm,
                             **p.op_args())  # fmt: skip
    return None


def plan_label(plan: LMHeadPlan) -> str:
    """A short form of a plan for tables: path, chunk or tile shape, loop order."""
    gemm = {"fused_epilogue": "epilogue", "separate": "separate"}.get(plan.gemm, "")
    if plan.chunk_rows is not None:
        return f"{plan.path} {gemm} C={plan.chunk_rows}"
    return f"{plan.path} {gemm} {plan.tile_rows}x{plan.tile_cols} {plan.loop_order}"


def _unfused_grpo(name: str):
    cfg = LOSSES[_UNFUSED[name]]

    def step(p: Problem):
        logp = vocab_parallel_logprobs(
            p.h, p.w, p.targets, rows=p.grpo["loss_mask"], impl="auto", **p.op_args()
        )
        loss, _ = grpo_loss(cfg, logprobs=logp, **p.grpo)
        loss.backward()
        return logp.detach(), None, loss.detach()

    return step


def _megatron(p: Problem):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    group = _megatron_group(p)
    h = p.h
    if group.size() > 1:  # as Megatron's ColumnParallelLinear: all-reduce d_hidden over TP
        h = copy_to_tensor_model_parallel_region(h, group=group)
    logits = (h @ p.w.t())[:, None, :]  # materialized [T, 1, V_local] in the input dtype
    logp = -fused_vocab_parallel_cross_entropy(logits, p.targets[:, None], group).squeeze(1)
    obj = (p.coef * logp.float()).sum()
    obj.backward()
    return logp.detach().float(), None, obj.detach()


def _cce(filter_eps):
    def step(p: Problem):
        from cut_cross_entropy import linear_cross_entropy

        ce = linear_cross_entropy(p.h, p.w, p.targets, reduction="none", filter_eps=filter_eps)
        logp = -ce.float()
        obj = (p.coef * logp).sum()
        obj.backward()
        return logp.detach(), None, obj.detach()

    return step


# name -> (step, objective of its gradients: "logp", "logp_entropy" or a LOSSES key)
METHODS: dict[str, tuple[Callable, str]] = {
    "torch": (_ours("torch", False), "logp"),
    "triton": (_ours("triton", False), "logp"),
    "triton_separate": (_ours("triton", False, "separate"), "logp"),
    "triton_sp": (_ours("triton", False), "logp"),
    "torch_entropy": (_ours("torch", True), "logp_entropy"),
    "triton_entropy": (_ours("triton", True), "logp_entropy"),
    **{name: (_fused_grpo(name), loss) for name, (_, _, loss) in _FUSED.items()},
    **{name: (_unfused_grpo(name), loss) for name, loss in _UNFUSED.items()},
    "megatron_fused_ce": (_megatron, "logp"),
    "cce_exact": (_cce(None), "logp"),
    "cce": (_cce("auto"), "logp"),
}


def clear_grads(p: Problem) -> None:
    p.h.grad = None
    p.w.grad = None
    if hasattr(p.w, "main_grad"):
        p.w.main_grad.zero_()


def weight_grad(p: Problem) -> torch.Tensor | None:
    """The weight gradient where it landed: main_grad (if any) else w.grad."""
    return getattr(p.w, "main_grad", p.w.grad)


def rel_err(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None:
        return float("nan")
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


SOLO_GROUP: list = []  # a one-rank process group for Megatron's CE when there is no TP


def _megatron_group(p: Problem):
    return p.group if p.group is not None else SOLO_GROUP[0]


# ----------------------------------------------------------------------------- GEMMs


def floor_ms(h: torch.Tensor, w: torch.Tensor, args, dev) -> dict:
    """The three bf16 GEMMs any exact method does: h W^T, G W, G^T h (G random [T, V_local])."""
    hd, wd = h.detach(), w.detach()
    g = torch.randn(hd.size(0), wd.size(0), device=dev, dtype=hd.dtype)
    ms = median_ms(lambda: (hd @ wd.t(), g @ wd, g.t() @ hd), dev, args.warmup, args.reps)
    return {"ms": ms, "tflops": 6 * hd.size(0) * hd.size(1) * wd.size(0) / ms / 1e9}


@contextmanager
def tf32(on: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _gemm_variants(hc, wd, g32):
    """name -> (fn, which reference): options for the op's three GEMMs on one chunk.

    "fp16 scaled": G times a power of two (so its small entries stay normal in fp16) and the
    bf16 operand converted to fp16 (exact within fp16's range), fp32 output, scale undone.
    """
    lo, f16, f32 = hc.dtype, torch.float16, torch.float32
    scale = 2.0 ** (14 - torch.frexp(g32.abs().max())[1].item())

    def tf32_on(fn):
        return lambda: _call_tf32(fn)

    return {
        "logits bf16 mm -> .float()": (lambda: (hc @ wd.t()).float(), "z"),
        "logits mm(out_dtype=fp32)": (lambda: torch.mm(hc, wd.t(), out_dtype=f32), "z"),
        "logits fp32 upcast": (lambda: hc.float() @ wd.float().t(), "z"),
        "logits fp32 upcast tf32": (tf32_on(lambda: hc.float() @ wd.float().t()), "z"),
        "dh G.bf16 @ W -> bf16": (lambda: g32.to(lo) @ wd, "dh"),
        "dh mm(G.bf16, W, out_dtype=fp32)": (lambda: torch.mm(g32.to(lo), wd, out_dtype=f32), "dh"),
        "dh fp16 scaled, out_dtype=fp32": (
            lambda: torch.mm((g32 * scale).to(f16), wd.to(f16), out_dtype=f32).div_(scale),
            "dh",
        ),
        "dh G fp32 @ W.float()": (lambda: g32 @ wd.float(), "dh"),
        "dh G fp32 @ W.float() tf32": (tf32_on(lambda: g32 @ wd.float()), "dh"),
        "dw G.bf16^T @ h -> bf16": (lambda: g32.to(lo).t() @ hc, "dw"),
        "dw mm(G.bf16^T, h, out_dtype=fp32)": (
            lambda: torch.mm(g32.to(lo).t(), hc, out_dtype=f32),
            "dw",
        ),
        "dw fp16 scaled, out_dtype=fp32": (
            lambda: torch.mm((g32 * scale).to(f16).t(), hc.to(f16), out_dtype=f32).div_(scale),
            "dw",
        ),
        "dw G^T fp32 @ h.float()": (lambda: g32.t() @ hc.float(), "dw"),
        "dw G^T fp32 @ h.float() tf32": (tf32_on(lambda: g32.t() @ hc.float()), "dw"),
    }


def _call_tf32(fn):
    with tf32(True):
        return fn()


def gemm_options(p: Problem, args, dev) -> dict:
    """Time and error (vs true fp32) of each GEMM option at the op's chunk sizes, with the
    d logits G = c * (onehot - softmax) of the chunk's real logits."""
    res = {}
    hd, wd = p.h.detach(), p.w.detach()
    for rows in args.gemm_rows:
        hc = hd[:rows].contiguous()
        with fp32_highest():
            w32, h32 = wd.float(), hc.float()
            z = h32 @ w32.t()
            g32 = torch.softmax(z[:, : p.vocab_size], dim=-1).mul_(-p.coef[:rows, None])
            g32 = torch.nn.functional.pad(g32, (0, wd.size(0) - p.vocab_size))
            g32.scatter_add_(1, p.targets[:rows, None], p.coef[:rows, None])
            refs = {"z": z, "dh": g32 @ w32, "dw": g32.t() @ h32}
            del w32, h32, z
        for name, (fn, which) in _gemm_variants(hc, wd, g32).items():
            key = f"{name} [rows={rows}]"
            try:
                err = rel_err(fn(), refs[which])
                ms = median_ms(fn, dev, args.warmup, args.reps)
                flops = 2 * rows * hd.size(1) * wd.size(0)
                res[key] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": err}
            except Exception as e:  # noqa: BLE001 - e.g. out_dtype missing in this torch
                res[key] = {"error": f"{type(e).__name__}: {e}"[:200]}
        del refs, g32
    return res
