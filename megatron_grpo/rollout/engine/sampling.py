"""Token sampling on the device from full-vocabulary fp32 logits.

One function serves every engine, so the recompute oracle and the KV-cached engine draw the same
token from the same logits and the same uniform number. Sampling is by inverse CDF: one uniform
``u`` per row (drawn up front from the caller's CPU generator, so every TP rank draws the same),
the first token whose cumulative probability exceeds ``u * total``. Only ``[b]`` tokens and
log-probs leave the device; the whole step is free of host syncs, so it can run in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_grpo.rollout.engine.params import SamplingParams


def sample(
    logits: Tensor, uniforms: Tensor, params: SamplingParams, rows_kernel: Callable | None = None
) -> tuple[Tensor, Tensor]:
    """One token per row: ``logits [b, V_padded]`` fp32, ``uniforms [b]`` in ``[0, 1)``.

    Returns ``(tokens [b] int64, logprobs [b] fp32)``: the recorded log-prob is
    ``log_softmax(logits / T)[token]`` over the real vocabulary, before top-k / top-p.
    ``rows_kernel`` (the decode plan's ``kernels.sample_rows``, or None) draws untruncated
    samples (no top-k / top-p) with one kernel that reads each row twice (this function is its
    reference); truncated sampling always runs here."""
    if logits.size(-1) < params.vocab_size:
        raise ValueError(
            f"logits have {logits.size(-1)} columns, fewer than vocab_size={params.vocab_size}"
        )
    if rows_kernel is not None and params.top_k == 0 and params.top_p == 1.0:
        return rows_kernel(logits, uniforms.float(), params.vocab_size, params.temperature)
    scaled = logits[:, : params.vocab_size].float() / params.temperature
    logp = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
    kept = _truncate(scaled, params)
    probs = logp.exp() if kept is scaled else torch.softmax(kept, dim=-1)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the search never steps past the last token with mass.
    target = torch.minimum(
        uniforms.to(cdf.dtype)[:, None] * total, torch.nextafter(total, 0 * total)
    )
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _truncate(scaled: Tensor, params: SamplingParams) -> Tensor:
    """``scaled`` with the tokens outside the top-k / top-p set at -inf (ties at a cut stay)."""
    kept = scaled
    if 0 < params.top_k < scaled.size(-1):
        cut = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        kept = kept.masked_fill(kept < cut, float("-inf"))
    if params.top_p < 1.0:
        ordered, _ = kept.sort(dim=-1, descending=True)
        p = torch.softmax(ordered, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
        drop = (p.cumsum(-1) - p) >= params.top_p
        cut = ordered.masked_fill(drop, float("inf")).amin(-1, keepdim=True)
        kept = kept.masked_fill(kept < cut, float("-inf"))
    return kept
