"""The benchmark's command line: the flags, the presets' defaults and the checks between flags.

Torch-free on purpose: ``tools/bench_train_passes.py`` parses before anything imports torch,
so that ``--device cpu`` can set ``TRITON_INTERPRET`` first. (Only the default of
``--logprob-merge`` imports the trainer's config, as it always did.)
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from .shapes import EXPERTS, preset


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (default ``sys.argv[1:]``) with every default resolved; a bad
    combination exits with argparse's usage error naming the flag."""
    ap = argparse.ArgumentParser(description=description)
    _add_model_args(ap)
    _add_moe_args(ap)
    _add_batch_args(ap)
    _add_run_args(ap)
    a = ap.parse_args(argv)
    resolve(a, ap.error)
    return a


def _add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="2 layers, hidden 64, vocab 512; 2 micro-batches of 256 tokens, "
                    "L = 256,32, 1 iteration (the CPU dry run; implied by --device cpu)")  # fmt: skip
    ap.add_argument("--dense8b", action="store_true", help="Qwen3-8B's layer shape: 4 layers, "
                    "hidden 4096, FFN 12288, heads 32/8 x 128, vocab 151936, untied")  # fmt: skip
    ap.add_argument("--tp", default="1", help="tensor-parallel size N (run under torchrun "
                    "--nproc-per-node N; SP on for N > 1), or a comma list of sizes run one "
                    "torchrun each, MFU side by side (tools/bench_tp.py)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=None, help="default 28 (Qwen3-0.6B)")
    ap.add_argument("--hidden", type=int, default=None, help="default 1024")
    ap.add_argument("--ffn", type=int, default=None, help="default 3072")
    ap.add_argument("--heads", type=int, default=None, help="query heads, default 16")
    ap.add_argument("--kv-heads", type=int, default=None, help="default 8")
    ap.add_argument("--head-dim", type=int, default=None, help="kv_channels, default 128")
    ap.add_argument("--vocab", type=int, default=None, help="default 151936")
    ap.add_argument("--untied", action="store_true", help="separate output layer (Qwen3-0.6B "
                    "ties it to the embedding)")  # fmt: skip
    ap.add_argument("--transformer-impl", choices=["local", "auto", "transformer_engine"],
                    default="local", help="ModelConfig.transformer_impl (local = the portable "
                    "spec, the one --rope acts on)")  # fmt: skip


def _add_moe_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--moe", action="store_true", help="an MoE model: Qwen3-30B-A3B's layer "
                    "shape (12 layers, hidden 2048, 128 experts top-8 of FFN 768, heads 32/4x128, "
                    "vocab 151936, untied), 2 micro-batches of 8192 tokens, L = 8192; MFU counts "
                    "active FLOPs (attention projections, router, top-k experts, LM head)")  # fmt: skip
    ap.add_argument("--experts", default="grouped", help="--moe: comma list of expert "
                    f"implementations {EXPERTS}, a model each (same seed), e.g. "
                    "sequential,grouped for before/after")  # fmt: skip
    ap.add_argument("--num-experts", type=int, default=None, help="--moe: default 128")
    ap.add_argument("--ep", type=int, default=1, help="--moe: expert_model_parallel_size "
                    "(one process per GPU under torchrun, expert-TP 1; the world size must be "
                    "a multiple)")  # fmt: skip
    ap.add_argument("--topk", type=int, default=None, help="--moe: default 8")
    ap.add_argument("--moe-ffn", type=int, default=None, help="--moe: default 768")


def _add_batch_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--micro-batches", type=int, default=None, help="default 4")
    ap.add_argument("--tokens", type=int, default=None, help="packed tokens per micro-batch "
                    "(default 8192)")  # fmt: skip
    ap.add_argument("--doc-lens", default=None, help="comma list of document lengths L, one "
                    "row each (default 8192,1024,128,32)")  # fmt: skip
    ap.add_argument("--mixed", default=None, help="LO-HI: one more row of documents with "
                    "lengths uniform in [LO, HI], new ones in every micro-batch of every pass "
                    "(as a trainer sees them: new attention bucket shapes)")  # fmt: skip
    ap.add_argument("--rope", default="auto", help="comma list of variants "
                    "ROPE[/LAYER[/BUCKETS[/ATTN]]]: the packed RoPE impl (auto, torch, triton, "
                    "megatron), optionally the norm + SwiGLU kernels (auto, torch, triton; "
                    "default auto), how the bucketed attention runs documents of mixed lengths "
                    "(plan_free, exact; default plan_free) and the packed attention path (auto, "
                    "varlen, blocked, buckets; default auto), e.g. megatron/torch,auto for "
                    "before/after")  # fmt: skip
    ap.add_argument("--logprob-path", default="fused", help="GRPOStep.logprob_path (the "
                    "trainer's lm_head.path; default fused)")  # fmt: skip
    ap.add_argument("--logprob-merge", type=int, default=None, help="the log-prob pass merges "
                    "micro-batches up to this many tokens, as the trainer does (default: its "
                    "training.logprob_max_tokens_per_micro_batch \"auto\" for a dense model, "
                    "LOGPROB_MERGE_TOKENS); 0: one forward per micro-batch")  # fmt: skip


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--top", type=int, default=15, help="kernels listed per profile")
    ap.add_argument("--kl-coef", type=float, default=0.001, help="loss.kl_coef (uses the ref)")
    ap.add_argument("--warmup", type=int, default=None, help="default 2 (--tiny: 1)")
    ap.add_argument("--iters", type=int, default=None, help="default 3 (--tiny: 1)")
    ap.add_argument("--floor-reps", type=int, default=5, help="timed reps per GEMM-floor shape")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 peak for MFU (H100 SXM: 989)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="torch.profiler kernel tables")
    ap.add_argument("--host-profile", action="store_true", help="cProfile of one pass of each "
                    "kind at --profile-len: the host's top Python functions")  # fmt: skip
    ap.add_argument("--profile-len", type=int, default=None, help="L of the profile (default "
                    "the smallest --doc-lens)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))


def resolve(a: argparse.Namespace, error: Callable[[str], None]) -> None:
    """Fill ``a``'s defaults from the preset shape and check the flags against each other
    (``error`` exits with the message; the checks run in this order)."""
    a.tiny = a.tiny or a.device == "cpu"  # the CPU run is a dry run: the tiny preset
    if a.dense8b and not a.tiny and a.moe:
        error("--dense8b and --moe are two shapes: pick one")
    shape = preset(a.tiny, a.moe, a.dense8b)
    from bench_tp import parse_sizes  # noqa: PLC0415 (tools/ is the script's path)

    a.tp = parse_sizes(a.tp)
    a.tp_size = a.tp[0] if len(a.tp) == 1 else None
    if a.moe and a.tp != [1]:
        error("--tp: the dense models only (MoE layers have their own expert parallelism)")
    for name, value in shape.items():
        if name != "tied" and getattr(a, name) is None:
            setattr(a, name, value)
    a.tied = not a.untied and shape["tied"]
    a.experts = [x.strip() for x in a.experts.split(",") if x.strip()] if a.moe else ["dense"]
    if any(x not in EXPERTS for x in a.experts) and a.moe:
        error(f"--experts: each of {EXPERTS}, got {a.experts}")
    _fill_run_defaults(a)
    _check_sizes(a, error)


def _fill_run_defaults(a: argparse.Namespace) -> None:
    """Batch, variant and iteration defaults (the tiny and MoE presets have their own)."""
    a.micro_batches = a.micro_batches or (2 if a.tiny or a.moe else 4)
    a.tokens = a.tokens or (256 if a.tiny else 8192)
    default_lens = "256,32" if a.tiny else ("8192" if a.moe else "8192,1024,128,32")
    a.doc_lens = [int(x) for x in (a.doc_lens or default_lens).split(",")]
    a.rope = [x.strip() for x in a.rope.split(",") if x.strip()]
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 2)
    a.iters = a.iters or (1 if a.tiny else 3)
    if a.logprob_merge is None:
        from megatron_grpo.train.config import LOGPROB_MERGE_TOKENS

        a.logprob_merge = LOGPROB_MERGE_TOKENS


def _check_sizes(a: argparse.Namespace, error: Callable[[str], None]) -> None:
    """``--ep``, the lengths (clipped to a micro-batch) and ``--mixed`` (appended as a row)."""
    if a.ep < 1 or (a.ep > 1 and not a.moe):
        error(f"--ep {a.ep}: a positive size, > 1 only with --moe")
    if min(a.doc_lens) < 2 or a.tokens < 2:
        error("--doc-lens and --tokens must be >= 2")
    a.doc_lens = [min(L, a.tokens) for L in a.doc_lens]  # a document fills a micro-batch at most
    a.profile_len = min(a.profile_len or min(a.doc_lens), a.tokens)
    if a.mixed:
        lo, _, hi = a.mixed.partition("-")
        if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
            error(f"--mixed: LO-HI with 1 <= LO <= HI, got {a.mixed!r}")
        a.doc_lens.append(a.mixed)
