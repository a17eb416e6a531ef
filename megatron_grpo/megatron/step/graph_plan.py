"""Whether the no-grad log-prob passes (:mod:`.logprob_graphs`) and the update's passes
(:mod:`.update_graphs`) replay CUDA graphs: the one decision of each,
``training.logprob_cuda_graphs`` and ``training.update_cuda_graphs`` (null = auto).

They can run where the forward never reads bounds or counts on the host: one pipeline stage, no
context parallelism, every attention on ``varlen_attn``, MoE layers on a dispatch without host
syncs, 16-bit weights, outside expandable segments. They pay where the forward is host-bound: a
replay saves the host's time of a forward (megatron-core's module code and launches, about
``HOST_MS_PER_LAYER`` a layer) and costs the padding to the graph's shape. One H200 (Intel
Xeon host), the 0.6B shape's pass: 2.2-2.6x faster at 4k-token micro-batches, 0.80-0.96x at 32k
ones (there the GEMMs take longer than the host); its fwd+bwd 2.8-3.4x at 4k, 1.25-1.95x at 8k.
Auto compares the two: the pass's GEMM time at ``FORWARD_TFLOPS`` (fwd+bwd: three times the
forward's) against the host's, per micro-batch. At EP > 1 every MoE layer's dispatch waits for
the expert group's slowest host, and graphs won where measured (:data:`EP_RANKS_WAIT`): auto
turns them on. Dense models at TP > 1 were not measured: auto leaves them off (``true`` runs).
"""

from __future__ import annotations

import torch

from megatron_grpo.megatron.attention.rope import PackedRopeSelfAttention, supports
from megatron_grpo.megatron.attention.sdpa import SDPAttention
from megatron_grpo.megatron.attention.varlen import varlen_unavailable
from megatron_grpo.megatron.cuda_graphs import expandable_segments
from megatron_grpo.megatron.gpt import unwrap
from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.moe.local_dispatch import host_sync_reason

KNOB = "training.logprob_cuda_graphs"
UPDATE_KNOB = "training.update_cuda_graphs"
# A no-grad forward's host time per decoder layer: the 0.6B shape's 28 layers took 34 ms a
# forward eager at 4k tokens on one H200's host (Intel Xeon), 15 ms replayed.
HOST_MS_PER_LAYER = 1.2
# A forward and backward's: the same shape's fwd+bwd took 131-150 ms a 4k micro-batch eager,
# 46-47 ms replayed (8k: 112-166 ms and 85 ms); 4.0 puts the crossover near 16k tokens, where
# the replayed passes' GPU time reaches the eager host time.
UPDATE_HOST_MS_PER_LAYER = 4.0
MOVING_GRADS = (
    "training.offload_during_rollout frees the gradient buffers the backward graphs add to, "
    "so they are captured again every step"
)
# The matmul rate a forward's GEMMs reach (bf16 on an H100 / H200: ~40% of the dense peak).
FORWARD_TFLOPS = 400.0


def _attention_unsupported(gpt: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """Why a layer's attention cannot run captured in ``dtype`` (None: every layer's can)."""
    cfg, device = gpt.config, next(gpt.parameters()).device
    q = torch.empty(1, cfg.num_attention_heads, cfg.kv_channels, dtype=dtype, device=device)
    kv = q[:, : cfg.num_query_groups or cfg.num_attention_heads]
    rope = getattr(gpt, "position_embedding_type", None) == "rope"
    for i, layer in enumerate(gpt.decoder.layers):
        attn = getattr(layer, "self_attention", None)
        core = getattr(attn, "core_attention", None)
        if not isinstance(core, SDPAttention) or core.packed not in ("auto", "varlen"):
            packed = getattr(core, "packed", type(core).__name__)
            return f"layer {i}: packed attention {packed!r} (captured forwards run 'varlen')"
        if rope and not (
            isinstance(attn, PackedRopeSelfAttention)
            and attn.packed_rope != "megatron"
            and supports(gpt.config)
        ):
            return f"layer {i}: megatron-core's per-document RoPE (it reads bounds on the host)"
        why = varlen_unavailable(q, kv, core.dropout_p)
        if why:
            return f"layer {i}: {why}"
    return None


def graphs_unsupported(chunks: list[torch.nn.Module], layout: ParallelLayout) -> str | None:
    """Why the log-prob passes of ``chunks`` cannot run captured (None: they can)."""
    if len(chunks) > 1 or layout.pp_size > 1:
        return "pipeline parallelism (one captured forward holds the whole model)"
    if layout.cp_size > 1:
        return "context parallelism (its attention reads the bounds on the host)"
    gpt = unwrap(chunks[0])
    if gpt.config.hidden_dropout > 0:  # captures skip the RNG tracker's forks (cuda_graphs)
        return f"hidden_dropout={gpt.config.hidden_dropout} (megatron-core's RNG tracker)"
    if next(gpt.parameters()).device.type != "cuda":
        return "a model on the CPU"
    expandable = expandable_segments()
    if expandable:
        return f"{expandable} (expandable segments: capture stalls)"
    if gpt.config.num_moe_experts is not None:
        why = host_sync_reason(gpt)
        if why:
            return f"MoE {why}"
    dtype = torch.bfloat16 if gpt.config.bf16 else torch.float16 if gpt.config.fp16 else None
    if dtype is None:
        return "fp32 parameters (varlen_attn needs 16-bit inputs)"
    return _attention_unsupported(gpt, dtype)


def active_matmul_params(gpt: torch.nn.Module) -> float:
    """The decoder's matmul weights one token meets on this rank: local (TP-sharded) weights,
    the experts' scaled by top-k over the local experts (the tokens of the expert group spread
    over them)."""
    cfg, total = gpt.config, 0.0
    local_experts = (cfg.num_moe_experts or 1) // max(cfg.expert_model_parallel_size, 1)
    for name, p in gpt.decoder.named_parameters():
        if p.dim() < 2:
            continue
        expert = cfg.num_moe_experts and ".experts." in name
        total += p.numel() * (cfg.moe_router_topk / local_experts if expert else 1)
    return total


def _pass_costs(gpt: torch.nn.Module, backward: bool) -> tuple[float, float]:
    """(GEMM ms a token at ``FORWARD_TFLOPS``, the host's ms) of a forward (``backward``: a
    forward and backward, three times the forward's GEMMs) of ``gpt``'s decoder."""
    passes = 3 if backward else 1
    per_token_ms = passes * 2 * active_matmul_params(gpt) / (FORWARD_TFLOPS * 1e9)
    per_layer = UPDATE_HOST_MS_PER_LAYER if backward else HOST_MS_PER_LAYER
    return per_token_ms, per_layer * len(gpt.decoder.layers)


def host_bound(gpt: torch.nn.Module, tokens: int, backward: bool = False) -> tuple[bool, str]:
    """Whether a forward (``backward``: a forward and backward) of ``tokens`` packed tokens
    waits on the host: its GEMMs' estimated time against ``HOST_MS_PER_LAYER``
    (``UPDATE_HOST_MS_PER_LAYER``) per layer; the reason with both numbers."""
    per_token_ms, host_ms = _pass_costs(gpt, backward)
    gemm_ms = per_token_ms * tokens
    bound = gemm_ms < host_ms
    what = "forward and backward" if backward else "forward"
    return bound, (
        f"a {what} of {tokens} tokens is {'host' if bound else 'GPU'}-bound "
        f"(~{gemm_ms:.1f} ms of GEMMs against ~{host_ms:.0f} ms of host time)"
    )


# A capture's host time in eager passes of its shape: it runs the pass twice (warm-up, capture).
# The dense twin's update measured more: ~0.48 s a shape at 4k tokens, ~3.3 eager fwd+bwd.
CAPTURE_PASSES = 2


def capture_padding_tokens(gpt: torch.nn.Module, backward: bool = False) -> int:
    """Padding tokens whose estimated GEMM time (as :func:`host_bound`'s) equals a capture's
    host time (``CAPTURE_PASSES`` eager passes): a micro-batch takes a larger shape that has a
    graph rather than capture its own when that adds fewer (``graph_shape.ShapeReuse``)."""
    per_token_ms, host_ms = _pass_costs(gpt, backward)
    return int(CAPTURE_PASSES * host_ms / max(per_token_ms, 1e-12))


def update_graphs_unsupported(chunks: list[torch.nn.Module], layout: ParallelLayout) -> str | None:
    """Why the update's forward and backward of ``chunks`` cannot run captured (None: they
    can): the log-prob passes' limits, and what a captured backward cannot replay."""
    return graphs_unsupported(chunks, layout) or backward_unsupported(chunks[0])


def backward_unsupported(chunk: torch.nn.Module) -> str | None:
    """What in ``chunk``'s training forward a replayed graph would get wrong (None: nothing)."""
    cfg = unwrap(chunk).config
    if cfg.recompute_granularity is not None:
        return f"activation recompute (recompute_granularity={cfg.recompute_granularity!r})"
    if cfg.hidden_dropout > 0 or cfg.attention_dropout > 0:
        return "dropout (a replay would draw the capture's random numbers)"
    if cfg.num_moe_experts and (cfg.moe_aux_loss_coeff or cfg.moe_z_loss_coeff):
        return "MoE aux / z losses (the padding tokens would join them)"
    ddp = getattr(chunk, "ddp_config", None)
    if ddp is None or any(
        getattr(p, "main_grad", None) is None for p in unwrap(chunk).parameters() if p.requires_grad
    ):
        return "a model without megatron-core's DDP gradient buffers (main_grad)"
    return None


def plan_logprob_graphs(
    chunks: list[torch.nn.Module],
    layout: ParallelLayout,
    requested: bool | None,
    tokens: int | None = None,
) -> tuple[bool, str]:
    """(whether the log-prob passes run captured, the start-up line's reason). ``requested``:
    ``training.logprob_cuda_graphs``: None = auto (where they run: at EP > 1, or at TP 1 where a
    micro-batch of ``tokens`` is host-bound; unknown ``tokens``: off). An
    explicit request that cannot be honoured is an error naming why."""
    why = graphs_unsupported(chunks, layout)
    return _plan(KNOB, why, chunks, layout, requested, tokens)


def plan_update_graphs(
    chunks: list[torch.nn.Module],
    layout: ParallelLayout,
    requested: bool | None,
    tokens: int | None = None,
    grads_move: bool = False,
) -> tuple[bool, str]:
    """:func:`plan_logprob_graphs` for the update's passes (``training.update_cuda_graphs``),
    auto by the forward and backward's estimate. ``grads_move``: the gradient buffers move
    between steps (``training.offload_during_rollout`` on), so the graphs, which add to them,
    would be captured again every step (a capture costs about two eager passes of its shape):
    off under auto; ``true`` keeps them and says so."""
    why = update_graphs_unsupported(chunks, layout)
    if grads_move and requested is None and why is None:
        return False, f"off under auto: {MOVING_GRADS}"
    on, line = _plan(UPDATE_KNOB, why, chunks, layout, requested, tokens, backward=True)
    return on, f"{line}; {MOVING_GRADS}" if on and grads_move else line


# Why auto captures at EP > 1 (measured, tools/gpu_e2e.sh moe_ep, one call on 2 x H200)
EP_RANKS_WAIT = (
    "each dispatch waits for the expert group's slowest host (the MoE twin at EP 2, TP 2 + SP, "
    "32k micro-batches: step 1.28x, log-prob 1.74x, update 1.55x with graphs)"
)


def _plan(
    knob: str,
    why: str | None,
    chunks: list[torch.nn.Module],
    layout: ParallelLayout,
    requested: bool | None,
    tokens: int | None,
    backward: bool = False,
) -> tuple[bool, str]:
    """The decision of ``knob`` given why the graphs cannot run (``why``) and the request."""
    if requested and why:
        raise ValueError(f"{knob}=true cannot apply: {why}; set it to null (auto) or false")
    if requested is not None:
        return requested, f"{'on' if requested else 'off'} ({knob}={str(requested).lower()})"
    if why:
        return False, f"off: {why}"
    gpt = unwrap(chunks[0])
    if gpt.config.expert_model_parallel_size > 1:
        return True, f"on under auto at EP > 1: {EP_RANKS_WAIT}"
    if layout.tp_size > 1:
        return False, f"off under auto at TP > 1 (not measured there; {knob}=true)"
    if tokens is None:
        return False, "off under auto: the passes' micro-batch size is unknown"
    bound, reason = host_bound(gpt, tokens, backward)
    return bound, f"{'on' if bound else 'off'}: {reason}"
