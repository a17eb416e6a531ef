"""The benchmarked models: the trainer's builder (TP ``--tp``, SP when > 1, EP ``--ep``),
one model per ``--rope`` variant ``ROPE[/LAYER[/BUCKETS[/ATTN[/QK[/GRAPHS[/TPO]]]]]]``, all with
the same weights."""

from __future__ import annotations

import torch
from megatron.core.parallel_state import model_parallel_is_initialized

from megatron_grpo.megatron import (
    ModelConfig,
    ParallelConfig,
    build_model,
    initialize_parallel,
    unwrap,
)
from megatron_grpo.megatron.attention.rope import PackedRopeSelfAttention
from megatron_grpo.ops.kernels import CHOICES, LayerKernels

IMPLS, LAYER_IMPLS, BUCKETS = CHOICES["rope"], CHOICES["impl"], CHOICES["attention"]
PACKED, QK, TPO = CHOICES["packed_attention"], CHOICES["qk_norm_rope"], CHOICES["tp_overlap"]
# the passes' CUDA graphs (training.logprob_cuda_graphs and update_cuda_graphs) by the sixth field
GRAPHS = {"": None, "auto": None, "eager": False, "graphs": True}


def check_variants(variants: list[str]) -> None:
    """Exit naming the ``--rope`` variants that are not
    ``ROPE[/LAYER[/BUCKETS[/ATTN[/QK[/GRAPHS[/TPO]]]]]]`` of the kernels' choices (or none
    given)."""

    def known(variant: str) -> bool:
        parts = variant.split("/")
        choices = (IMPLS, ("", *LAYER_IMPLS), ("", *BUCKETS), ("", *PACKED), ("", *QK), GRAPHS,
                   ("", *TPO))  # fmt: skip
        return len(parts) <= 7 and all(p in c for p, c in zip(parts, choices, strict=False))

    unknown = [r for r in variants if not known(r)]
    if unknown or not variants:
        raise SystemExit(f"--rope: {unknown or variants}: ROPE in {IMPLS}, LAYER in "
                         f"{LAYER_IMPLS}, BUCKETS in {BUCKETS}, ATTN in {PACKED}, QK in {QK}, "
                         f"GRAPHS in {tuple(GRAPHS)}, TPO in {TPO}")  # fmt: skip


def graphs_requested(variant: str) -> bool | None:
    """The sixth field of a variant as ``training.logprob_cuda_graphs`` and
    ``training.update_cuda_graphs`` (both passes): "" / "auto" = None
    (auto: where they run and the pass's micro-batch is host-bound), "eager" = False, "graphs"
    = True (an error where they cannot)."""
    return GRAPHS[(variant.split("/") + [""] * 6)[5]]


def layer_kernels(variant: str) -> LayerKernels:
    """A ``ROPE[/LAYER[/BUCKETS[/ATTN[/QK[/GRAPHS[/TPO]]]]]]`` variant as the model's kernels:
    the packed RoPE impl, the layers' element-wise kernels (default "auto"), how the bucketed
    attention runs documents of mixed lengths (default "plan_free"), the packed attention path
    (default "auto"), whether the q / k norms fuse with RoPE (``qk_norm_rope``, default
    "auto") and the SP linear layers' collectives (``tp_overlap``, default "auto"; GRAPHS is
    read by :func:`graphs_requested`)."""
    rope, layer, buckets, attn, qk, _, tpo = (variant.split("/") + [""] * 6)[:7]
    return LayerKernels(elementwise=layer or "auto", rope=rope, attention=buckets or "plan_free",
                        packed_attention=attn or "auto", qk_norm_rope=qk or "auto",
                        tp_overlap=tpo or "auto")  # fmt: skip


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
