"""Model FLOPs and MFU: forward 2 N per token (N = the decoder's matmul weights a token meets
+ the LM head), causal attention 2 * 2 * heads * head_dim * L (L + 1) / 2 per document and
layer; fwd+bwd = 3x forward; MFU = FLOPs / (time * peak of the TP group)."""

from __future__ import annotations

import statistics

from megatron_grpo.megatron import PackedBatch


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


def pass_stats(times: list[float], peak_gib: float | None, mult: int, flops: dict,
               floor_ms: float, peak: float) -> dict:  # fmt: skip
    """One pass's cell of a row from its timed runs (ms): the median, tokens/s, MFU
    (``mult`` x the forward FLOPs, 3 for fwd+bwd; ``peak`` FLOP/s of the TP group), MFU with
    the head on the scored rows only, time over the GEMM floor, peak GiB."""
    ms = statistics.median(times)
    return dict(ms=ms, times_ms=times, tokens_per_s=flops["tokens"] / (ms / 1e3),
                mfu=mult * flops["total"] / (ms / 1e3) / peak,
                mfu_head_scored=mult * flops["total_head_scored"] / (ms / 1e3) / peak,
                x_floor=ms / floor_ms, peak_gib=peak_gib)  # fmt: skip
