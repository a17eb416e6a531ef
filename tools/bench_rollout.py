"""Generation throughput: our KV-cached engine (eager and CUDA graphs) against HF transformers'
``generate`` and the HBM roofline, in one run, with per-token log-probs and peak memory.

One GPU, Qwen3-0.6B shape (random weights, bf16), 256 prompts of 256 tokens, 1024 new tokens
each, eos disabled::

    python tools/bench_rollout.py --out $OUT
    torchrun --nproc-per-node 2 tools/bench_rollout.py --preset 8b --no-hf --out $OUT  # TP=2
    torchrun --nproc-per-node 4 tools/bench_rollout.py --preset 8b --no-hf \
        --modes graphs@gathered,graphs@vocab_parallel --out $OUT  # TP=4: how the next token is drawn

Roofline: every decode step reads the weights of this rank once plus every row's cached K/V;
the sum over steps at the GPU's HBM bandwidth bounds the new tokens per second. Prefill and the
LM-head GEMM are left out of the bound (small at this shape), so it is optimistic.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

PRESETS = {  # Qwen3 shapes
    "0.6b": dict(num_layers=28, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                 kv_channels=128, ffn_hidden_size=3072, share_embeddings_and_output_weights=True),
    "8b": dict(num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
               kv_channels=128, ffn_hidden_size=12288),
    # one TP 4 rank's share of the 8B shape, on one GPU: its GEMMs, attention and K/V bytes
    # without the all-reduces (what a step's compute costs, split in halves or not)
    "8b-tp4-rank": dict(num_layers=36, hidden_size=4096, num_attention_heads=8,
                        num_query_groups=2, kv_channels=128, ffn_hidden_size=3072,
                        vocab_size=151936 // 4),
    # the MoE twin (recipes/qwen3_30b_a3b_moe_twin.yaml) at EP 1: a replica's decode at EP > 1
    "moe-twin": dict(num_layers=12, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                     kv_channels=128, ffn_hidden_size=3072, num_moe_experts=32,
                     moe_router_topk=4, moe_ffn_hidden_size=384, vocab_size=13),
}  # fmt: skip
HBM_TBPS = {"H200": 4.8, "H100": 3.35}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="0.6b")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=float, default=None, help="default: auto (the engine's)")
    p.add_argument("--kv-cache-fraction", type=float, default=0.9)
    p.add_argument(
        "--modes", default="graphs,graphs-modules,eager",
        help="comma list of graphs | eager, each optionally -fused | -modules (the decode path) "
        "and then -sdpa | -triton (the decode attention), and @gathered | @vocab_parallel (how "
        "TP > 1 draws the next token, rollout.engine.tp_sampling), /nccl | /one_shot (the "
        "fused step's TP all-reduce, rollout.engine.tp_all_reduce) and +off | +halves "
        "(rollout.engine.decode_overlap; at TP 1 +halves forces the split, its cost alone); "
        "default: the engine's auto",
    )  # fmt: skip
    p.add_argument("--eager-new-tokens", type=int, default=None, help="shorter eager run")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers generate")
    p.add_argument("--hf-new-tokens", type=int, default=None, help="default: --new-tokens")
    p.add_argument("--profile", default=None, help="kernel table of decode steps of this mode")
    p.add_argument("--out", default=None)
    return p.parse_args()


def build(args: argparse.Namespace):
    from megatron_grpo.megatron import ModelConfig, ParallelConfig, build_model, unwrap
    from megatron_grpo.megatron.parallel import initialize_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    shape = dict(PRESETS[args.preset])
    cfg = ModelConfig(
        vocab_size=shape.pop("vocab_size", args.vocab),
        max_sequence_length=args.prompt_len + args.new_tokens + 256,
        layernorm_epsilon=1e-6, qk_layernorm=True, rotary_base=1000000,
        params_dtype="bfloat16", transformer_impl="local", **shape,
    )  # fmt: skip
    parallel = ParallelConfig(tensor_model_parallel_size=world)
    initialize_parallel(parallel, seed=0)
    return cfg, unwrap(build_model(cfg, parallel, wrap_ddp=False)[0])


def roofline(model, cfg, args, tbps: float) -> float:
    """New tokens/s if each decode step only streamed weights + K/V at HBM bandwidth."""
    from megatron_grpo.rollout.engine.kv_cache import CacheShape

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = CacheShape.of(model).bytes_per_token
    total = 0.0
    for t in range(args.new_tokens):
        context = args.prompt_len + t + 1
        total += weights + args.prompts * context * per_token
    return args.prompts * args.new_tokens / (total / (tbps * 1e12))


def engine_options(args, mode: str):
    """``graphs`` / ``eager`` with an optional ``-fused`` / ``-modules`` decode path, ``-sdpa`` /
    ``-triton`` attention, ``@gathered`` / ``@vocab_parallel`` sampling at TP > 1 and
    ``/nccl`` / ``/one_shot`` for the fused step's TP all-reduce, ``+off`` / ``+halves`` for
    ``decode_overlap`` (off at TP 1: :func:`make_engine` forces the split there)."""
    from megatron_grpo.rollout import EngineOptions

    mode, _, overlap = mode.partition("+")
    if overlap and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        overlap = "off"
    mode, _, reduce = mode.partition("/")
    mode, _, sampling = mode.partition("@")
    graphs, _, rest = mode.partition("-")
    path, _, attention = rest.partition("-")
    if graphs not in ("graphs", "eager"):
        raise ValueError(f"--modes: {mode!r} is not graphs | eager [-fused | -modules "
                         "[-sdpa | -triton]]")  # fmt: skip
    return EngineOptions(
        kv_cache_gib=args.kv_cache_gib, kv_cache_fraction=args.kv_cache_fraction,
        cuda_graphs=graphs == "graphs",
        decode_path=path or "auto", decode_attention=attention or "auto",
        tp_sampling=sampling or "auto", tp_all_reduce=reduce or "auto",
        decode_overlap=overlap or "auto",
    )  # fmt: skip


def make_engine(model, options, mode: str):
    """The engine of ``mode``; ``+halves`` at TP 1 (no sum to overlap: an error for a recipe)
    splits every step anyway, to time what the halves cost without the overlap."""
    import dataclasses

    from megatron_grpo.rollout import KVCacheEngine
    from megatron_grpo.rollout.engine import decode_overlap

    engine = KVCacheEngine(model, options)
    if mode.endswith("+halves") and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        rows = decode_overlap.EXPLICIT_ROWS
        engine.decode = dataclasses.replace(engine.decode, overlap_rows=rows)
    return engine


def run_ours(model, cfg, args, mode: str, new_tokens: int) -> dict:
    from megatron_grpo.rollout import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (args.prompts, args.prompt_len), generator=g)
    params = SamplingParams(
        temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, eos_id=0,
        vocab_size=cfg.vocab_size, ignore_eos=True,
    )  # fmt: skip
    engine = make_engine(model, engine_options(args, mode), mode)
    result = {"decode": str(engine.decode)}
    for label in ("cold", "warm"):  # cold: includes graph captures; warm: graphs reused
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = engine.generate(prompts.tolist(), params, g)
        responses, logprobs = out.responses, out.logprobs
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        new = sum(len(r) for r in responses)
        assert all(len(lp) == len(r) for lp, r in zip(logprobs, responses, strict=True))
        result[label] = dict(
            seconds=seconds, tokens_per_s=new / seconds,
            peak_gib_over_weights=(torch.cuda.max_memory_allocated() - base) / 2**30,
            **engine.stats,  # graph_captures: this call's
        )  # fmt: skip
    return result


def profile(model, cfg, args) -> str:
    """Kernel table of 8 decode steps of mode ``--profile`` at a context of ~768 (the run's
    mean) and full batch, prefill excluded (one prefill forward admits every prompt), with the
    steps' wall time and the GPU-busy share of it."""
    import dataclasses

    from torch.profiler import ProfilerActivity, profile

    from megatron_grpo.rollout import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (args.prompts, 760), generator=g).tolist()
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=9, eos_id=0,
                            vocab_size=cfg.vocab_size, ignore_eos=True)  # fmt: skip
    options = engine_options(args, args.profile)
    options = dataclasses.replace(options, max_prefill_tokens=args.prompts * 760, keep_cache=True)
    engine = make_engine(model, options, args.profile)
    engine.generate(prompts, params, g)  # warm-up (and graph captures)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    launch = engine._launch

    def profiled_launch(*a, **kw):
        if engine.stats["decode_steps"] == 0:
            torch.cuda.synchronize()
            prof.start()
        return launch(*a, **kw)

    engine._launch = profiled_launch
    engine.generate(prompts, params, g)
    torch.cuda.synchronize()
    prof.stop()
    steps = engine.stats["decode_steps"]
    wall = engine.stats["decode_seconds"] / steps
    averages = prof.key_averages()
    replay = ""
    if engine.graphs is not None and engine.graphs.graphs:  # the steps' graph alone, back to back
        graph = list(engine.graphs.graphs.values())[-1]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            graph.replay()
        torch.cuda.synchronize()
        replay = f", graph replay alone {1e3 * (time.perf_counter() - t0) / 8:.2f} ms/step"
    busy = sum(e.self_device_time_total for e in averages if e.device_type.name == "CUDA")
    head = (f"{args.profile} ({engine.decode}): {steps} decode steps, wall "
            f"{1e3 * wall:.2f} ms/step, kernels {busy / 1e3 / steps:.2f} "
            f"ms/step{replay}\n")  # fmt: skip
    return head + averages.table(sort_by="self_device_time_total", row_limit=40)


def run_hf(cfg, args) -> dict:
    """HF transformers generate (dynamic cache, SDPA, eager), same shape, no log-probs."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    new = args.hf_new_tokens or args.new_tokens
    hf_cfg = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.kv_channels, max_position_embeddings=cfg.max_sequence_length,
        tie_word_embeddings=cfg.share_embeddings_and_output_weights, rope_theta=1e6,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = Qwen3ForCausalLM(hf_cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.prompts, args.prompt_len), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new,
            min_new_tokens=new, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    made = (out.size(1) - args.prompt_len) * args.prompts
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model
    torch.cuda.empty_cache()
    return dict(new_tokens=new, seconds=seconds, tokens_per_s=made / seconds, peak_gib=peak)


def main() -> None:
    args = parse()
    cfg, model = build(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    name = torch.cuda.get_device_name()
    tbps = next((v for k, v in HBM_TBPS.items() if k in name), 3.35)
    if args.out and rank == 0:
        os.makedirs(args.out, exist_ok=True)
    report = dict(device=name, world=int(os.environ.get("WORLD_SIZE", "1")), args=vars(args),
                  roofline_tokens_per_s=roofline(model, cfg, args, tbps), hbm_tbps=tbps)  # fmt: skip
    for mode in args.modes.split(","):
        graphs = mode.startswith("graphs")
        new = args.new_tokens if graphs else (args.eager_new_tokens or args.new_tokens)
        runs = sum(k.split("#")[0] == mode for k in report)
        key = f"{mode}#{runs + 1}" if runs else mode
        report[key] = dict(new_tokens=new, **run_ours(model, cfg, args, mode, new))
        if rank == 0:  # a repeated mode (A B A B) keeps each run: "graphs#2"
            print(key, json.dumps(report[key]), flush=True)
    if args.profile:
        table = profile(model, cfg, args)
        if rank == 0:
            print(table, flush=True)
            if args.out:
                with open(
                    os.path.join(args.out, f"profile_{args.profile.replace('/', '_')}.txt"), "w"
                ) as f:
                    f.write(table)
    if not args.no_hf and report["world"] == 1:
        del model
        torch.cuda.empty_cache()
        report["hf_generate"] = run_hf(cfg, args)
    if rank == 0:
        print(json.dumps(report, indent=1), flush=True)
        if args.out:
            path = os.path.join(args.out, f"bench_rollout_{args.preset}_w{report['world']}.json")
            with open(path, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
