"""The driver: per expert implementation a model per ``--rope`` variant, every row, the
profiles; then the tables and ``results.json`` (rank 0)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import GRPOStep, unwrap

from . import dist
from .flops import matmul_params
from .models import check_variants, graphs_requested, variant_models
from .passes import Passes, run_row
from .profiling import host_profile, run_profile
from .report import (
    comparison,
    label,
    print_comparison,
    print_model,
    print_row_line,
    print_rows,
    run_info,
)


def _empty_cache(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _model_info(gpt, cfg, decoder: int, head: int) -> dict:
    return dict(
        config={k: v for k, v in vars(cfg).items() if not k.startswith("yarn")},
        params=sum(p.numel() for p in gpt.parameters()), decoder_matmul_params=decoder,
        head_params=head, dtype=str(next(gpt.parameters()).dtype), optimizer_step=False,
    )  # fmt: skip


def _step(args, cfg, chunks, variant: str) -> GRPOStep:
    """The variant's step: the loss options of the flags, its passes' CUDA graphs."""
    step = GRPOStep(GRPOLossConfig(kl_coef=args.kl_coef), vocab_size=cfg.vocab_size,
                    logprob_path=args.logprob_path)  # fmt: skip
    tokens = max(args.logprob_merge or 0, args.tokens)  # the passes' micro-batch, merged or not
    requested = graphs_requested(variant)  # both passes
    why = step.plan_logprob_graphs(chunks, requested, tokens)
    print(f"{variant}: log-prob passes: CUDA graphs {why}", flush=True)
    why = step.plan_update_graphs(chunks, requested, args.tokens)
    print(f"{variant}: fwd+bwd passes: CUDA graphs {why}", flush=True)
    return step


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
    group = torch.distributed.group.WORLD if args.ep > 1 else None
    variants = {r: Passes(_step(args, cfg, c, r), c, args.logprob_merge, group)
                for r, (_, c) in models.items()}  # fmt: skip
    decoder, head = matmul_params(gpt, cfg.vocab_size)
    decoder *= args.tp_size  # every decoder GEMM weight is split over TP: the model's FLOPs
    info.setdefault("models", {})[experts] = _model_info(gpt, cfg, decoder, head)
    print_model(args, experts, info["models"][experts])
    for L in args.doc_lens:
        for rope in args.rope:
            name = label(args, experts, rope)
            row = run_row(L, name, variants[rope], gpt, args, dev, (decoder, head), first)
            rows.append(row)
            print_row_line(row)
            _empty_cache(dev)
    if args.profile:
        prof += run_profile(variants, args, dev, out, experts)
    if args.host_profile:
        host_profile(variants, args, dev)
    del variants, models, gpt, chunks
    gc.collect()
    _empty_cache(dev)
    return weights


def main(args, script: str) -> int:
    """Run the benchmark of the parsed ``args`` (``script``: the entry point, which ``--tp
    1,2,4`` runs under torchrun once per size); the exit status."""
    dist.silence_other_ranks()
    dev = torch.device(args.device)
    dist.set_device(dev)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny for a dry run", file=sys.stderr)
        return 2
    check_variants(args.rope)
    out = Path(args.out)
    if args.tp_size is None:  # a list of sizes: one torchrun each
        return dist.tp_sweep(script, args.tp, out)
    dist.check_world(args.tp_size, args.ep)
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
    if dist.RANK == 0:
        (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"\nwrote {out / 'results.json'}")
    return 0
