"""Row statistics of a logits chunk in one pass over the vocab: max, sum-exp, target, entropy.

For each row of ``z = logits * inv_temperature`` restricted to the ``n_valid`` real columns:
``m = max z``, ``s = sum exp(z - m)``, ``zt = z[target]`` and ``b = sum exp(z - m) * z``.
The TP combine of these per-shard stats lives in ``megatron_grpo.ops``.

Each program owns one row and keeps per-lane online max/sum-exp accumulators over the vocab
tiles (one exp per element: the larger of the running max and the new value gets exp(0) = 1),
folded into row scalars once at the end. Padded columns (>= n_valid) are never loaded, so they
never add exp(0); lanes that saw no valid column keep m = -inf and are weighted by exactly 0,
so an empty shard gives (m, s, b) = (-inf, 0, 0), never NaN.
"""

from __future__ import annotations

import functools

import torch

from ._runtime import (
    autotune_enabled,
    check_device,
    check_logits,
    check_row_vector,
    check_scalars,
    interpret_mode,
    require_triton,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the launcher raises a clear error on use
    triton = None
    tl = None

# The fixed default config (autotuning only with MEGATRON_GRPO_AUTOTUNE=1): 4096 fp32 lanes in
# 8 warps = 16 elements per thread and three accumulators, well inside the register budget.
BLOCK_V = 4096
NUM_WARPS = 8


def _row_stats_kernel(
    logits_ptr,
    targets_ptr,
    m_ptr,
    s_ptr,
    zt_ptr,
    b_ptr,
    n_valid,
    stride_row,
    inv_temperature,
    BLOCK_V: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK_V)
    m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s_vec = tl.zeros([BLOCK_V], tl.float32)
    b_vec = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, n_valid, BLOCK_V):
        cols = start + lanes
        valid = cols < n_valid
        z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
        grow = z > m_vec
        # exp(-|z - m|) is the factor for whichever of (old sum, new term) has the smaller max;
        # m = -inf gives exp(-inf) = 0, which zeroes the (empty) old sum.
        e = tl.exp(-tl.abs(z - m_vec))
        s_new = tl.where(grow, s_vec * e + 1.0, s_vec + e)
        s_vec = tl.where(valid, s_new, s_vec)
        if HAS_ENTROPY:
            b_new = tl.where(grow, b_vec * e + z, b_vec + e * z)
            b_vec = tl.where(valid, b_new, b_vec)
        m_vec = tl.where(valid, tl.maximum(m_vec, z), m_vec)
    m = tl.max(m_vec, axis=0)
    # Lanes with no valid column (m_vec = -inf) get weight exp(-inf) = 0; the shift by 0 for an
    # empty row keeps -inf - (-inf) = NaN out of the arithmetic.
    scale = tl.exp(m_vec - tl.where(m == float("-inf"), 0.0, m))
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, tl.sum(s_vec * scale, axis=0))
    if HAS_ENTROPY:
        tl.store(b_ptr + row, tl.sum(b_vec * scale, axis=0))
    target = tl.load(targets_ptr + row)
    in_shard = (target >= 0) & (target < n_valid)
    x_t = tl.load(row_ptr + tl.where(in_shard, target, 0), mask=in_shard, other=0.0)
    tl.store(zt_ptr + row, x_t.to(tl.float32) * inv_temperature)


def _autotune_configs() -> list:
    return [
        triton.Config({"BLOCK_V": block}, num_warps=warps)
        for block in (1024, 2048, 4096, 8192)
        for warps in (4, 8, 16)
        if block // (32 * warps) >= 4
    ]


@functools.cache
def _build(interpret: bool, autotune: bool):
    """The kernel for one (interpreter, autotune) mode; `interpret` keys the cache only."""
    require_triton()
    kernel = triton.heuristics({"HAS_ENTROPY": lambda args: args["b_ptr"] is not None})(
        triton.jit(_row_stats_kernel)
    )
    if autotune:
        kernel = triton.autotune(configs=_autotune_configs(), key=["n_valid"])(kernel)
    return kernel


def logits_row_stats(
    logits: torch.Tensor,
    targets_local: torch.Tensor,
    n_valid: int,
    inv_temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (m, s, zt, b) of ``z = logits * inv_temperature`` over the first n_valid columns.

    Args:
        logits: [C, V_local] float32/bf16/fp16 raw logits (accumulated in fp32), last dim
            contiguous.
        targets_local: [C] int64, target - vocab_start; outside [0, n_valid) = not in this shard.
        n_valid: real (non-padded) columns, 0 <= n_valid <= V_local.
        inv_temperature: 1 / temperature, finite and > 0.
        with_entropy: also return b.

    Returns:
        (m, s, zt, b), each [C] float32: m = max z (-inf if n_valid == 0), s = sum exp(z - m)
        (0 if n_valid == 0), zt = z[target] if the target is in this shard else 0,
        b = sum exp(z - m) * z (None unless with_entropy; 0 if n_valid == 0).
    """
    require_triton()
    check_logits("logits", logits)
    rows, v_local = logits.shape
    check_row_vector("targets_local", targets_local, rows, torch.int64, logits.device)
    check_scalars(n_valid, v_local, inv_temperature)
    check_device("logits", logits)
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, s, zt = (torch.empty(rows, **f32) for _ in range(3))
    b = torch.empty(rows, **f32) if with_entropy else None
    if rows == 0:
        return m, s, zt, b
    autotune = autotune_enabled()
    kernel = _build(interpret_mode(), autotune)
    args = (logits, targets_local, m, s, zt, b, n_valid, logits.stride(0), float(inv_temperature))
    if autotune:
        kernel[(rows,)](*args)
    else:
        kernel[(rows,)](*args, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return m, s, zt, b
