"""Benchmark: the training passes of the trainer on packed micro-batches, per document length.

Per document length L (``--doc-lens``) and packed-RoPE implementation (``--rope``), on one GPU
(Qwen3-0.6B shape by default, random weights, bf16, TP=1, the portable layer spec)::

    python tools/bench_train_passes.py --rope megatron,auto --out $OUT        # before / after
    python tools/bench_train_passes.py --rope megatron,auto --doc-lens 8192 --profile \\
        --profile-len 8192 --out $OUT                                         # kernel tables

(On the lent GPU machine first ``. tools/gpu_env.sh; WHEELS=wheels install_carried`` with
wheels/ carried. The first command took about 4 minutes on an H100: megatron-core's RoPE loop
at L=32 alone costs ~18 s per fwd+bwd pass.)

Expert parallelism (``--moe --ep N``, one process per GPU under torchrun; expert-TP 1, every
rank its own micro-batches as data-parallel ranks have; MFU per GPU from the rank's active
FLOPs; rank 0 prints and writes)::

    torchrun --nproc-per-node 4 tools/bench_train_passes.py --moe --ep 4 --out $OUT
    torchrun --nproc-per-node 4 tools/bench_train_passes.py --moe --ep 4 --mixed 100-4000 \
        --profile --profile-len 8192 --out $OUT        # kernel tables (a trace per rank)

CPU dry run of the same logic (tiny model; run by tests/test_tools.py)::

    python tools/bench_train_passes.py --device cpu --tiny --rope megatron,auto

The passes are the trainer's own calls (``megatron_grpo/train/trainer.py``):

* log-prob: ``GRPOStep.compute_logprobs(chunks, micro_batches, max_tokens)``, the no-grad pass
  of the old and reference log-probs (megatron-core's forward-only schedule, results copied to
  the host), over micro-batches merged up to ``--logprob-merge`` tokens as the trainer's
  default merges them (``0``: one forward per micro-batch);
* fwd+bwd: megatron-core's ``forward_backward_func`` with ``GRPOStep.forward_step`` over the
  micro-batches (``forward_only=False``), as ``Trainer._forward_backward``: the GRPO loss, the
  backward into the DDP gradient buffers and the schedule's ``finalize_model_grads``. No
  optimizer step (the gradient buffers are zeroed before each iteration, outside the timing).

Every micro-batch is ``--tokens`` packed tokens: documents of L tokens (one shorter document
takes the rest when L does not divide it), prompt = the first half, response (loss mask) = the
second; advantages random per document, old log-probs = the log-prob pass's output (as the
trainer sets them), reference log-probs = old + noise (``--kl-coef`` uses them).

``--mixed LO-HI`` adds a row of documents with lengths uniform in [LO, HI], new ones in every
micro-batch of every timed pass, as a trainer meets them (each pass brings the attention new
bucket shapes; FLOPs and MFU are those of the first batches).

``--rope`` (a comma list of ``ROPE[/LAYER[/BUCKETS[/ATTN]]]``) is the model's
``ModelConfig.layer_kernels`` (``LayerKernels(rope=ROPE, elementwise=LAYER,
attention=BUCKETS, packed_attention=ATTN)``, what a recipe's ``model.layer_kernels`` sets): each variant is a model of
its own, built with it and loaded with the first one's weights (GPU memory: one model per
variant), the rows of one L back to back: "megatron" is
megatron-core's per-document loop (the "before"), "auto" / "torch" / "triton" our packed RoPE;
BUCKETS "exact" runs mixed-length documents on torch's SDPA choice (cuDNN on Hopper, a plan
per new shape), the default "plan_free" on flash / memory-efficient. ATTN is the packed
attention path (auto, varlen, blocked, buckets; default auto), e.g.
``auto/auto/plan_free/buckets,auto/auto/plan_free/varlen`` for the length-bucketed SDPA against
one varlen_attn call per layer (issue 42). The comparison table gives
each variant's time over the first one's (after / before; < 1 is faster).

Timing: ``--warmup`` iterations, then the median of ``--iters``, each between
``synchronize`` + ``perf_counter``. Tokens/s counts all packed tokens (prompt too). MFU = model
FLOPs / (time * ``--peak-tflops``): forward 2 * N per token, N = the decoder's matmul weights +
the LM head (vocab x hidden, counted on every token), plus causal attention 2 * 2 * heads *
head_dim * L (L + 1) / 2 per document and layer; fwd+bwd = 3x forward. (The trainer's LM head
only runs on loss-mask rows: ``mfu_head_scored`` in the JSON counts the head there only.)
"x floor" = time over the GEMM floor: cuBLAS alone on the pass's dense GEMMs (each layer's
linear layers on T tokens, the LM head on the loss-mask rows; fwd+bwd: fwd, d input and
d weight), timed on random tensors of the model's dtype right before each row. Peak memory:
``torch.cuda.max_memory_allocated`` over the timed iterations of each pass (reset before it;
includes the weights, fp32 gradient buffers and inputs).

``--dense8b``: Qwen3-8B's layer shape (4 layers of hidden 4096, FFN 12288, heads 32/8 x 128,
vocab 151936, untied). ``--tp N``: tensor parallelism N (sequence parallel on for N > 1) under
``torchrun --nproc-per-node N`` (data-parallel size 1); MFU is per GPU (model FLOPs / (time * N
* peak)). ``--tp 1,2,4`` without torchrun runs each size under its own torchrun in turn and
prints their MFU side by side (tools/bench_tp.py), e.g. on 4 GPUs::

    python tools/bench_train_passes.py --dense8b --tp 1,2,4 --tokens 32768 --micro-batches 2 \\
        --doc-lens 8192 --mixed 100-4000 --out $OUT/tp

``--profile``: at L = ``--profile-len`` (default the smallest of ``--doc-lens``), one log-prob
pass and one fwd+bwd pass per rope impl under ``torch.profiler``: the top ``--top`` kernels (calls,
total ms, % of GPU time), kernel launches per pass, GPU busy time (the union of kernel
intervals) vs wall time; a gzipped Chrome trace each under ``--out``.

``--host-profile``: cProfile of one pass of each kind at ``--profile-len`` (the last variant):
the ``--top`` Python functions by own time, where a host-bound pass spends it.

``--out DIR``: ``results.json`` (args, device, versions, model, FLOPs, rows, comparison,
profile).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

QWEN3_0_6B = dict(layers=28, hidden=1024, ffn=3072, heads=16, kv_heads=8, head_dim=128,
                  vocab=151936, tied=True)  # fmt: skip
# --dense8b: Qwen3-8B's layer shape (36 layers there)
QWEN3_8B_LAYERS = dict(layers=4, hidden=4096, ffn=12288, heads=32, kv_heads=8, head_dim=128,
                       vocab=151936, tied=False)  # fmt: skip
TINY = dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=512, tied=True)
# --moe: Qwen3-30B-A3B's layer shape (48 layers there), every layer MoE
QWEN3_30B_A3B = dict(layers=12, hidden=2048, ffn=6144, heads=32, kv_heads=4, head_dim=128,
                     vocab=151936, tied=False, num_experts=128, topk=8, moe_ffn=768)  # fmt: skip
TINY_MOE = dict(TINY, num_experts=8, topk=2, moe_ffn=32)
EXPERTS = ("sequential", "grouped")  # megatron-core's SequentialMLP / our GroupedExperts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    a = ap.parse_args(argv)
    a.tiny = a.tiny or a.device == "cpu"  # the CPU run is a dry run: the tiny preset
    shape = (TINY_MOE if a.tiny else QWEN3_30B_A3B) if a.moe else (TINY if a.tiny else QWEN3_0_6B)
    if a.dense8b and not a.tiny:
        if a.moe:
            ap.error("--dense8b and --moe are two shapes: pick one")
        shape = QWEN3_8B_LAYERS
    from bench_tp import parse_sizes  # noqa: PLC0415 (tools/ is the script's path)

    a.tp = parse_sizes(a.tp)
    a.tp_size = a.tp[0] if len(a.tp) == 1 else None
    if a.moe and a.tp != [1]:
        ap.error("--tp: the dense models only (MoE layers have their own expert parallelism)")
    for name, value in shape.items():
        if name != "tied" and getattr(a, name) is None:
            setattr(a, name, value)
    a.tied = not a.untied and shape["tied"]
    a.experts = [x.strip() for x in a.experts.split(",") if x.strip()] if a.moe else ["dense"]
    if any(x not in EXPERTS for x in a.experts) and a.moe:
        ap.error(f"--experts: each of {EXPERTS}, got {a.experts}")
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
    if a.ep < 1 or (a.ep > 1 and not a.moe):
        ap.error(f"--ep {a.ep}: a positive size, > 1 only with --moe")
    if min(a.doc_lens) < 2 or a.tokens < 2:
        ap.error("--doc-lens and --tokens must be >= 2")
    a.doc_lens = [min(L, a.tokens) for L in a.doc_lens]  # a document fills a micro-batch at most
    a.profile_len = min(a.profile_len or min(a.doc_lens), a.tokens)
    if a.mixed:
        lo, _, hi = a.mixed.partition("-")
        if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
            ap.error(f"--mixed: LO-HI with 1 <= LO <= HI, got {a.mixed!r}")
        a.doc_lens.append(a.mixed)
    return a


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    # Triton builds its library for the interpreter only if this is set before its first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from megatron.core.parallel_state import model_parallel_is_initialized  # noqa: E402

from megatron_grpo.loss import GRPOLossConfig, reduce_metrics  # noqa: E402
from megatron_grpo.megatron import (  # noqa: E402
    GRPOStep,
    ModelConfig,
    PackedBatch,
    ParallelConfig,
    build_model,
    get_forward_backward_func,
    initialize_parallel,
    pack_sequences,
    unwrap,
)
from megatron_grpo.megatron.attention.rope import PackedRopeSelfAttention  # noqa: E402
from megatron_grpo.ops.kernels import CHOICES, LayerKernels  # noqa: E402

IMPLS, LAYER_IMPLS, BUCKETS = CHOICES["rope"], CHOICES["impl"], CHOICES["attention"]
PACKED = CHOICES["packed_attention"]

GIB = 2**30
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
if RANK:  # torchrun: rank 0 prints the tables and writes the results
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115

# ----------------------------------------------------------------------------- model, batches


def build(args, dev: torch.device, experts: str, kernels: LayerKernels):
    """(ModelConfig, DDP-wrapped chunks) of the trainer's builder running ``kernels``;
    TP = ``--tp`` (SP when > 1), EP ``--ep``, PP = 1."""
    moe = {}
    if args.moe:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.topk,
                   moe_ffn_hidden_size=args.moe_ffn, moe_grouped_gemm=experts == "grouped")  # fmt: skip
    cfg = ModelConfig(
        vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden,
        ffn_hidden_size=args.ffn, num_attention_heads=args.heads, num_query_groups=args.kv_heads,
        kv_channels=args.head_dim, max_sequence_length=args.tokens,
        normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True,
        gated_linear_unit=True, activation_func="silu", rotary_base=1000000,
        share_embeddings_and_output_weights=args.tied, transformer_impl=args.transformer_impl,
        params_dtype="bfloat16" if dev.type == "cuda" else "float32", layer_kernels=kernels,
        **moe,
    )  # fmt: skip
    tp = args.tp_size
    parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                              expert_model_parallel_size=args.ep,
                              expert_tensor_parallel_size=1 if args.ep > 1 else None)  # fmt: skip
    if not model_parallel_is_initialized():
        initialize_parallel(parallel, seed=args.seed)
    return cfg, build_model(cfg, parallel)


def _doc_lens(L: int | str, tokens: int, g: torch.Generator) -> list[int]:
    """Document lengths filling ``tokens``: all L (the last one cut), or for "LO-HI" uniform
    in [LO, HI]."""
    if isinstance(L, int):
        return [L] * (tokens // L) + ([tokens % L] if tokens % L else [])
    lo, hi = (int(x) for x in L.split("-"))
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(int(torch.randint(lo, hi + 1, (1,), generator=g)), tokens - sum(lens)))
    return lens


def _seed(L: int | str, args) -> int:
    """The batches' seed; each rank its own (data-parallel ranks hold different data)."""
    return args.seed + (L if isinstance(L, int) else 7919) + 100003 * RANK


def make_batches(L: int | str, args, seed: int) -> list[PackedBatch]:
    """``--micro-batches`` packed batches of ``--tokens`` tokens: documents of L tokens (or of
    ``--mixed`` lengths, new ones in each micro-batch)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(args.micro_batches):
        lens = _doc_lens(L, args.tokens, g)
        seqs = [torch.randint(0, args.vocab, (n,), generator=g) for n in lens]
        masks = [torch.arange(n) >= n // 2 for n in lens]
        old = [-(torch.rand(n, generator=g) * 2 + 0.1) for n in lens]
        ref = [o - 0.05 * torch.rand(n, generator=g) for o, n in zip(old, lens, strict=True)]
        adv = torch.randn(len(lens), generator=g)
        batches.append(pack_sequences(seqs, masks, advantages=adv, old_logprobs=old,
                                      ref_logprobs=ref, pad_to_multiple_of=args.tp_size))  # fmt: skip
    return batches


def set_old_logprobs(batches: list[PackedBatch], logprobs: list[torch.Tensor], seed: int) -> None:
    """What the trainer does with the log-prob pass: old = its output, here ref = old + noise."""
    g = torch.Generator().manual_seed(seed)
    for b, lp in zip(batches, logprobs, strict=True):
        b.old_logprobs = lp.float()
        b.ref_logprobs = lp.float() - 0.05 * torch.rand(lp.shape, generator=g)


# ----------------------------------------------------------------------------- FLOPs


def matmul_params(gpt, vocab: int) -> tuple[int, int]:
    """(decoder matmul weights a token meets, LM-head weights vocab x hidden) of the GPTModel;
    MoE: the routed experts count ``topk`` experts' weights (the active ones), the router its."""
    decoder = sum(p.numel() for n, p in gpt.named_parameters()
                  if p.dim() == 2 and n.startswith("decoder.") and ".experts." not in n)  # fmt: skip
    cfg = gpt.config
    if cfg.num_moe_experts:
        glu = 3 if cfg.gated_linear_unit else 2
        per_expert = glu * cfg.hidden_size * cfg.moe_ffn_hidden_size
        decoder += cfg.num_layers * cfg.moe_router_topk * per_expert
    return decoder, vocab * cfg.hidden_size


def forward_flops(batches: list[PackedBatch], args, decoder: int, head: int) -> dict:
    """Forward model FLOPs of the micro-batches: dense 2 N per token (the head on all tokens
    and, ``head_scored``, on the loss-mask rows only), causal attention per document."""
    tokens = sum(b.num_tokens for b in batches)
    scored = sum(int(b.loss_mask.sum()) for b in batches)
    attn = 0
    for b in batches:
        lens = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).long()
        attn += int((lens * (lens + 1) // 2).sum())
    attn *= 2 * 2 * args.heads * args.head_dim * args.layers
    dense = 2 * decoder * tokens
    return dict(tokens=tokens, scored_rows=scored, attention=attn,
                total=dense + 2 * head * tokens + attn,
                total_head_scored=dense + 2 * head * scored + attn)  # fmt: skip


# ----------------------------------------------------------------------------- timing


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, warmup: int, iters: int, setup=None) -> tuple[list[float], float | None]:
    """(ms of each of ``iters`` runs after ``warmup``, peak GiB over the timed runs)."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        if setup:
            setup()
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / GIB if dev.type == "cuda" else None
    return times, peak


def _mm_ms(m: int, k: int, n: int, dev, dtype, reps: int) -> tuple[float, float, float]:
    """Median ms of the GEMMs of one linear layer on m rows: forward [m,k]x[k,n], d input
    [m,n]x[n,k], d weight [n,m]x[m,k] (random inputs)."""
    x = torch.randn(m, k, device=dev, dtype=dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype)
    g = torch.randn(m, n, device=dev, dtype=dtype)
    out = []
    for fn in (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x):
        times, _ = timed(fn, dev, 2, reps)
        out.append(statistics.median(times))
    return tuple(out)


def gemm_floor(gpt, args, dev, scored_rows: int) -> dict:
    """cuBLAS time of the dense GEMMs of one pass over all micro-batches: every decoder weight
    [n, k] on ``--tokens`` rows per layer, the LM head on the micro-batch's loss-mask rows."""
    dtype = next(gpt.parameters()).dtype
    shapes = [(args.tokens, p.shape[1], p.shape[0]) for n, p in gpt.named_parameters()
              if p.dim() == 2 and n.startswith("decoder.layers.0.") and ".experts." not in n]  # fmt: skip
    cfg = gpt.config
    if cfg.num_moe_experts:  # the routed rows through one expert's shapes: one ideal GEMM each
        rows, fc1 = args.tokens * cfg.moe_router_topk, 2 * cfg.moe_ffn_hidden_size
        shapes += [(rows, cfg.hidden_size, fc1), (rows, cfg.moe_ffn_hidden_size, cfg.hidden_size)]
    fwd = bwd = 0.0
    for m, k, n in shapes:
        f, di, dw = _mm_ms(m, k, n, dev, dtype, args.floor_reps)
        fwd, bwd = fwd + f * args.layers, bwd + (di + dw) * args.layers
    rows = max(1, round(scored_rows / args.micro_batches))
    vocab = -(-args.vocab // args.tp_size)  # the vocab-parallel head's rows on this rank
    f, di, dw = _mm_ms(rows, args.hidden, vocab, dev, dtype, args.floor_reps)
    fwd, bwd = (fwd + f) * args.micro_batches, (bwd + di + dw) * args.micro_batches
    return dict(logprob_ms=fwd, train_ms=fwd + bwd)


# ----------------------------------------------------------------------------- passes


class Passes:
    """The trainer's two passes over a list of micro-batches."""

    def __init__(self, step: GRPOStep, chunks: list[torch.nn.Module], merge: int, count_group=None):
        self.step, self.chunks, self.merge = step, chunks, merge or None
        self.count_group = count_group  # EP > 1: the ranks agree on the forward count

    def logprob(self, batches: list[PackedBatch]) -> list[torch.Tensor]:
        return self.step.compute_logprobs(self.chunks, batches, self.merge, self.count_group)

    def zero_grads(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def train(self, batches: list[PackedBatch]) -> list[dict]:
        return get_forward_backward_func()(
            forward_step_func=self.step.forward_step,
            data_iterator=iter(batches),
            model=self.chunks[0] if len(self.chunks) == 1 else self.chunks,
            num_microbatches=len(batches),
            seq_length=max(b.num_tokens for b in batches),
            micro_batch_size=1,
            forward_only=False,
        )


def layer_kernels(variant: str) -> LayerKernels:
    """A ``ROPE[/LAYER[/BUCKETS[/ATTN]]]`` variant as the model's kernels: the packed RoPE impl,
    the layers' element-wise kernels (default "auto"), how the bucketed attention runs documents
    of mixed lengths (default "plan_free") and the packed attention path (default "auto")."""
    rope, layer, buckets, attn = (variant.split("/") + ["", "", ""])[:4]
    return LayerKernels(elementwise=layer or "auto", rope=rope, attention=buckets or "plan_free",
                        packed_attention=attn or "auto")  # fmt: skip


def variant_models(args, dev, experts: str, weights) -> dict:
    """``{variant: (cfg, chunks)}``: one model per ``--rope`` variant, each loaded with the
    first one's weights (or ``weights``)."""
    models = {}
    for rope in args.rope:
        cfg, chunks = build(args, dev, experts, layer_kernels(rope))
        gpt = unwrap(chunks[0])
        if not any(isinstance(m, PackedRopeSelfAttention) for m in gpt.modules()):
            raise SystemExit("--rope acts on the portable spec (--transformer-impl local)")
        if weights is not None:  # SequentialMLP's per-expert keys load into GroupedExperts too
            gpt.load_state_dict(weights)
        elif models:
            gpt.load_state_dict(unwrap(next(iter(models.values()))[1][0]).state_dict())
        models[rope] = (cfg, chunks)
    return models


def run_row(L: int | str, impl: str, passes: Passes, gpt, args, dev, params: tuple[int, int],
            first: dict) -> dict:  # fmt: skip
    """One table row; ``first`` keeps the first impl's log-probs of each L (the same batches
    and weights: the others' max abs difference to them is ``logp_max_abs_vs_first``). A
    ``--mixed`` row times new batches in every pass (their FLOPs: those of the first ones)."""
    batches = make_batches(L, args, seed=_seed(L, args))
    logprobs = passes.logprob(batches)
    set_old_logprobs(batches, logprobs, seed=_seed(L, args) + 1)
    logp = torch.cat(logprobs)
    diff = (logp - first.setdefault(L, logp)).abs().max().item()
    flops = forward_flops(batches, args, *params)
    floor = gemm_floor(gpt, args, dev, flops["scored_rows"])  # timed now: the clock drifts
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    passes.zero_grads()
    report = reduce_metrics(passes.train(batches))  # a warm-up too; the loss of the row
    box, fresh = [batches], itertools.count()

    def renew() -> None:  # --mixed: every pass sees new layouts (random old / ref log-probs)
        if isinstance(L, str):
            box[0] = make_batches(L, args, seed=_seed(L, args) + 7 * next(fresh) + 2)

    lp_times, lp_peak = timed(lambda: passes.logprob(box[0]), dev, args.warmup, args.iters,
                              setup=renew)  # fmt: skip
    tr_times, tr_peak = timed(lambda: passes.train(box[0]), dev, args.warmup, args.iters,
                              setup=lambda: (passes.zero_grads(), renew()))  # fmt: skip
    grad_sq = sum(float(p.main_grad.float().pow(2).sum()) for c in passes.chunks
                  for p in c.parameters() if getattr(p, "main_grad", None) is not None)  # fmt: skip
    row = dict(L=L, rope=impl, docs_per_mb=len(batches[0].cu_seqlens) - 1,
               tokens=flops["tokens"], scored_rows=flops["scored_rows"], flops=flops,
               loss=report.get("loss/loss"), grad_norm=grad_sq**0.5,
               logp_max_abs_vs_first=diff, floor_ms=floor)  # fmt: skip
    peak = args.peak_tflops * 1e12 * args.tp_size  # MFU per GPU of the TP group
    for name, times, mem, mult, floor_ms in (
        ("logprob", lp_times, lp_peak, 1, floor["logprob_ms"]),
        ("train", tr_times, tr_peak, 3, floor["train_ms"]),
    ):
        ms = statistics.median(times)
        row[name] = dict(ms=ms, times_ms=times, tokens_per_s=flops["tokens"] / (ms / 1e3),
                         mfu=mult * flops["total"] / (ms / 1e3) / peak,
                         mfu_head_scored=mult * flops["total_head_scored"] / (ms / 1e3) / peak,
                         x_floor=ms / floor_ms, peak_gib=mem)  # fmt: skip
    return row


# ----------------------------------------------------------------------------- profile


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
    batches = make_batches(L, args, seed=_seed(L, args))
    set_old_logprobs(batches, passes.logprob(batches), seed=_seed(L, args) + 1)
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
        batches = make_batches(L, args, seed=_seed(L, args))
        set_old_logprobs(batches, passes.logprob(batches), seed=_seed(L, args) + 1)
        passes.zero_grads()
        passes.train(batches)  # warm (compiles, caches) before the profiled passes
        tag = f"L{L}_{impl.replace('/', '-').replace(':', '_')}"
        for name, fn in (("logprob", passes.logprob), ("train", passes.train)):
            r = profile_pass(name, partial(fn, batches), passes.zero_grads, args, dev, out, tag)
            r.update(L=L, rope=impl)
            results.append(r)
            print_profile(r, dev)
    return results


# ----------------------------------------------------------------------------- reports


def _g(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


def print_rows(rows: list[dict]) -> None:
    print("\n| L | docs/mb | rope | logprob ms | logprob tok/s | logprob MFU | logprob x floor "
          "| fwd+bwd ms | fwd+bwd tok/s | fwd+bwd MFU | fwd+bwd x floor | peak GiB logprob "
          "| peak GiB fwd+bwd |")  # fmt: skip
    print("|" + "---|" * 13)
    for r in rows:
        cells = [str(r["L"]), str(r["docs_per_mb"]), r["rope"]]
        for p in (r["logprob"], r["train"]):
            cells += [f"{p['ms']:.1f}", f"{p['tokens_per_s']:.4g}", f"{100 * p['mfu']:.3g}%",
                      f"{p['x_floor']:.2f}"]  # fmt: skip
        cells += [_g(r["logprob"]["peak_gib"], ".2f"), _g(r["train"]["peak_gib"], ".2f")]
        print("| " + " | ".join(cells) + " |", flush=True)


def comparison(rows: list[dict], impls: list[str]) -> list[dict]:
    """Each impl after the first against the first (the "before"), per L and pass."""
    by = {(r["L"], r["rope"]): r for r in rows}
    out = []
    for L in dict.fromkeys(r["L"] for r in rows):
        before = by.get((L, impls[0]))
        for impl in impls[1:]:
            after = by.get((L, impl))
            if before is None or after is None:
                continue
            for name in ("logprob", "train"):
                b, a = before[name]["ms"], after[name]["ms"]
                out.append(dict(L=L, pass_=name, before=impls[0], after=impl, before_ms=b,
                                after_ms=a, ratio=a / b, speedup=b / a))  # fmt: skip
    return out


def print_comparison(comp: list[dict]) -> None:
    if not comp:
        return
    print("\n| L | pass | before | after | before ms | after ms | after/before | speedup |")
    print("|" + "---|" * 8)
    for c in comp:
        name = "fwd+bwd" if c["pass_"] == "train" else c["pass_"]
        print(f"| {c['L']} | {name} | {c['before']} | {c['after']} | {c['before_ms']:.1f} | "
              f"{c['after_ms']:.1f} | {c['ratio']:.3f} | {c['speedup']:.2f}x |")  # fmt: skip


def print_profile(r: dict, dev) -> None:
    unit, busy = ("kernels", "GPU") if dev.type == "cuda" else ("leaf CPU ops", "CPU ops")
    name = "fwd+bwd" if r["pass_"] == "train" else r["pass_"]
    print(
        f"\n== profile L={r['L']} rope={r['rope']} {name}: wall {r['wall_ms']:.1f} ms, "
        f"{busy} busy {r['busy_ms']:.1f} ms ({100 * r['busy_ms'] / r['wall_ms']:.0f}% of wall), "
        f"{r['launches']} {unit} + {r['memcpy_memset']} memcpy/memset; trace {r['trace']}"
    )
    print("| kernel | calls | total ms | % GPU time |\n|---|---|---|---|")
    for k in r["top"]:
        print(f"| `{k['name'][:100]}` | {k['calls']} | {k['ms']:.2f} | {k['pct']:.1f}% |")


def run_info(args, dev) -> dict:
    import megatron.core
    import triton

    def git_head() -> str | None:
        cmd = ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    return dict(device=name, device_type=dev.type, args=vars(args), tp=args.tp_size,
                world_size=WORLD, torch=torch.__version__,
                megatron_core=megatron.core.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, git_head=git_head(),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))  # fmt: skip


# ----------------------------------------------------------------------------- main


def label(args, experts: str, rope: str) -> str:
    """A row's variant: the rope variant, prefixed with the expert implementation (--moe)."""
    return f"{experts}:{rope}" if args.moe else rope


def run_model(args, dev, experts: str, out: Path, acc: tuple, info: dict, weights):
    """Build the model with ``experts`` (a fresh one per implementation; MoE models after the
    first load the first one's weights: the log-prob column then compares them), run every
    row, profile; returns the weights for the next (host copies) or None."""
    rows, first, prof = acc
    models = variant_models(args, dev, experts, weights)
    cfg, chunks = models[args.rope[0]]
    gpt = unwrap(chunks[0])
    if weights is None and len(args.experts) > 1:
        weights = {k: v.cpu() if torch.is_tensor(v) else v for k, v in gpt.state_dict().items()}
    step = GRPOStep(GRPOLossConfig(kl_coef=args.kl_coef), vocab_size=cfg.vocab_size,
                    logprob_path=args.logprob_path)  # fmt: skip
    group = torch.distributed.group.WORLD if args.ep > 1 else None
    variants = {r: Passes(step, c, args.logprob_merge, group) for r, (_, c) in models.items()}
    decoder, head = matmul_params(gpt, cfg.vocab_size)
    decoder *= args.tp_size  # every decoder GEMM weight is split over TP: the model's FLOPs
    info.setdefault("models", {})[experts] = dict(
        config={k: v for k, v in vars(cfg).items() if not k.startswith("yarn")},
        params=sum(p.numel() for p in gpt.parameters()), decoder_matmul_params=decoder,
        head_params=head, dtype=str(next(gpt.parameters()).dtype), optimizer_step=False,
    )  # fmt: skip
    moe = f", {args.num_experts} experts top-{args.topk} FFN {args.moe_ffn} ({experts})"
    print(f"model: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, heads "
          f"{args.heads}/{args.kv_heads}x{args.head_dim}, vocab {args.vocab}"
          f"{moe if args.moe else ''}, {'tied' if args.tied else 'untied'}, "
          f"{info['models'][experts]['dtype']}, {info['models'][experts]['params'] / 1e6:.1f}M "
          f"params ({(decoder + head) / 1e6:.1f}M matmul per token incl. the head); "
          f"{args.micro_batches} x {args.tokens} tokens; TP {args.tp_size}"
          f"{' + SP' if args.tp_size > 1 else ''}; logprob_path {args.logprob_path}; "
          f"log-prob pass merged to {args.logprob_merge or 'no'} tokens; fwd+bwd without "
          "optimizer step", flush=True)  # fmt: skip
    for L in args.doc_lens:
        for rope in args.rope:
            name = label(args, experts, rope)
            row = run_row(L, name, variants[rope], gpt, args, dev, (decoder, head), first)
            rows.append(row)
            print(
                f"L={L} {name}: logprob {row['logprob']['ms']:.1f} ms, fwd+bwd "
                f"{row['train']['ms']:.1f} ms, loss {_g(row['loss'])}, log-probs vs the first "
                f"variant: max abs {row['logp_max_abs_vs_first']:.3g}",
                flush=True,
            )
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if args.profile:
        prof += run_profile(variants, args, dev, out, experts)
    if args.host_profile:
        host_profile(variants, args, dev)
    del variants, models, step, gpt, chunks
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return weights


def main() -> int:
    args = ARGS or parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny for a dry run", file=sys.stderr)
        return 2

    def known(variant: str) -> bool:
        parts = variant.split("/")
        choices = (IMPLS, ("", *LAYER_IMPLS), ("", *BUCKETS), ("", *PACKED))
        return len(parts) <= 4 and all(p in c for p, c in zip(parts, choices, strict=False))

    unknown = [r for r in args.rope if not known(r)]
    if unknown or not args.rope:
        raise SystemExit(f"--rope: {unknown or args.rope}: ROPE in {IMPLS}, LAYER in "
                         f"{LAYER_IMPLS}, BUCKETS in {BUCKETS}, ATTN in {PACKED}")  # fmt: skip
    out = Path(args.out)
    if args.tp_size is None:  # a list of sizes: one torchrun each
        if "RANK" in os.environ:
            raise SystemExit("--tp: under torchrun give one size (a list runs torchrun itself)")
        import bench_tp

        return bench_tp.sweep(__file__, sys.argv[1:], args.tp, out)
    if args.ep == 1 and WORLD != args.tp_size:
        raise SystemExit(f"--tp {args.tp_size} needs torchrun --nproc-per-node {args.tp_size} "
                         f"(world size {WORLD}; the timings use data-parallel size 1)")  # fmt: skip
    if args.ep > 1 and (WORLD % args.tp_size or WORLD % args.ep):
        raise SystemExit(f"--ep {args.ep} --tp {args.tp_size}: the world size {WORLD} must be a "
                         "multiple of both (torchrun --nproc-per-node)")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    info = run_info(args, dev)
    print(
        f"device: {info['device']}  torch {info['torch']}  megatron-core "
        f"{info['megatron_core']}  peak {args.peak_tflops:g} TFLOP/s"
    )
    rows, first, prof, weights = [], {}, [], None
    for experts in args.experts:
        weights = run_model(args, dev, experts, out, (rows, first, prof), info, weights)
    labels = [label(args, e, r) for e in args.experts for r in args.rope]
    print_rows(rows)
    comp = comparison(rows, labels)
    print_comparison(comp)
    result = dict(info, rows=rows, comparison=comp, profile=prof or None)
    if RANK == 0:
        (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"\nwrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
