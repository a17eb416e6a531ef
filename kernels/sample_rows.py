"""One token per row by inverse CDF from fp32 logits, with its log-prob, in two passes over the row.

For row i with ``z = logits[i, :V] / temperature`` and a uniform ``u[i]`` in ``[0, 1)``:

* pass 1: ``m = max z``, ``s = sum exp(z - m)`` (per-lane online accumulators, as in
  ``logits_row_stats``), ``lse = m + log s``;
* pass 2: the running sum of ``exp(z - m)`` in column order; the token is the first column where
  it exceeds ``u * s`` (the last column with mass if rounding leaves the target above the end).

``logp = z[token] - lse``: ``log_softmax(z)[token]`` over the real vocabulary. This is the plain
(no top-k / top-p) case of ``megatron_grpo.rollout.engine.sampling.sample``, its reference:
the same token up to the rounding of the cumulative sums (a target within a few ulps of a CDF
step can land on either side). Padded columns (``>= V``) are never read.
"""

from __future__ import annotations

import functools

import torch

from ._runtime import check_device, interpret_mode, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the launcher raises a clear error on use
    triton = None
    tl = None

BLOCK_V = 4096
NUM_WARPS = 8


def _sample_rows_kernel(
    logits_ptr, u_ptr, tokens_ptr, logp_ptr, V, stride_row, temperature,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK_V)
    m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s_vec = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + lanes
        valid = cols < V
        z = tl.load(row_ptr + cols, mask=valid, other=float("-inf")) / temperature
        grow = z > m_vec
        e = tl.exp(-tl.abs(z - m_vec))  # the smaller side's factor; 0 while m_vec = -inf
        s_new = tl.where(grow, s_vec * e + 1.0, s_vec + e)
        s_vec = tl.where(valid, s_new, s_vec)
        m_vec = tl.where(valid, tl.maximum(m_vec, z), m_vec)
    m = tl.max(m_vec, axis=0)
    s = tl.sum(s_vec * tl.exp(m_vec - m), axis=0)
    target = tl.load(u_ptr + row) * s
    running = 0.0
    token = V  # none yet
    last = 0  # the last column with mass: the fallback
    for start in range(0, V, BLOCK_V):
        cols = start + lanes
        valid = cols < V
        z = tl.load(row_ptr + cols, mask=valid, other=float("-inf")) / temperature
        e = tl.where(valid, tl.exp(z - m), 0.0)
        cdf = tl.cumsum(e, axis=0) + running
        hit = tl.min(tl.where((cdf > target) & (e > 0), cols, V), axis=0)
        token = tl.minimum(token, hit)
        last = tl.maximum(last, tl.max(tl.where(e > 0, cols, 0), axis=0))
        running = running + tl.sum(e, axis=0)
    token = tl.where(token < V, token, last)
    z_t = tl.load(row_ptr + token) / temperature
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logp_ptr + row, z_t - (m + tl.log(s)))


@functools.cache
def _build(interpret: bool):
    """The kernel for one run mode; ``interpret`` keys the cache only."""
    require_triton()
    return triton.jit(_sample_rows_kernel)


def sample_rows(
    logits: torch.Tensor, uniforms: torch.Tensor, vocab_size: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [b] int64, logprobs [b] fp32)`` from ``logits [b, V_padded]`` fp32 (last dim
    contiguous) and ``uniforms [b]`` fp32 in ``[0, 1)``, over the first ``vocab_size`` columns."""
    require_triton()
    check_device("logits", logits)
    b = logits.size(0)
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a [b, V] float32 tensor, got {logits.dtype} "
                         f"{list(logits.shape)}")  # fmt: skip
    if not 0 < vocab_size <= logits.size(1):
        raise ValueError(f"vocab_size must be in (0, {logits.size(1)}], got {vocab_size}")
    if uniforms.shape != (b,) or uniforms.dtype != torch.float32:
        raise ValueError(f"uniforms must be float32 [{b}], got {uniforms.dtype} "
                         f"{list(uniforms.shape)}")  # fmt: skip
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logp = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b:
        _build(interpret_mode())[(b,)](
            logits, uniforms.contiguous(), tokens, logp, vocab_size, logits.stride(0),
            float(temperature), BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
        )  # fmt: skip
    return tokens, logp
