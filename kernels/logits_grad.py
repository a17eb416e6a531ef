"""Softmax-gradient epilogue: d logits of a chunk from its global log-sum-exp and d logp/d H.

With ``z = logits * inv_temperature`` and ``p = exp(z - lse)`` on the valid columns (0 on the
padded ones)::

    dz = grad_logp * (onehot(target) - p) - grad_entropy * p * (z - entropy_pz)
    dlogits = dz * inv_temperature

One program per row streams the row's tiles once: read logits, write d logits. In place:
``out`` may be ``logits`` itself (every element is read and written by the same thread), or a
narrower-dtype view over the logits' memory whose row r starts at fp32 row r (the op writes bf16
d logits into the first half of each fp32 logits row). Then tile k's stores land on fp32 columns
``< (k + 1) * BLOCK_V``, all read by tile k or before, but by other threads: a CTA barrier
between the loads and the stores of each tile orders them (rows belong to one program each).
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

# The fixed default config (autotuning only with MEGATRON_GRPO_AUTOTUNE=1).
BLOCK_V = 4096
NUM_WARPS = 8


def _grad_kernel(
    logits_ptr,
    targets_ptr,
    lse_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    entropy_pz_ptr,
    shift_ptr,
    out_ptr,
    n_valid,
    v_local,
    stride_row,
    stride_out_row,
    inv_temperature,
    n_rows,
    shift_block,
    BLOCK_V: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    NARROW_ALIAS: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    out_row_ptr = out_ptr + row * stride_out_row
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    g_logp = tl.load(grad_logp_ptr + row)
    if HAS_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + row)
        pz = tl.load(entropy_pz_ptr + row)
    lanes = tl.arange(0, BLOCK_V)
    for start in range(0, v_local, BLOCK_V):
        cols = start + lanes
        valid = cols < n_valid
        x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_SHIFT:  # x = z - m of the column's block (head_gemm's shifted logits)
            shift = tl.load(shift_ptr + (cols // shift_block) * n_rows + row, mask=valid, other=0.0)
            z = x + shift
        else:
            z = x * inv_temperature
        p = tl.exp(tl.where(valid, z - lse, float("-inf")))  # exactly 0 on padded columns
        onehot = tl.where(valid & (cols == target), 1.0, 0.0)
        dz = g_logp * (onehot - p)
        if HAS_ENTROPY:
            dz -= g_ent * p * (z - pz)
        dlogits = dz * inv_temperature
        if NARROW_ALIAS:
            tl.debug_barrier()  # every thread's loads of this tile are done (see module doc)
        tl.store(out_row_ptr + cols, dlogits.to(out_ptr.dtype.element_ty), mask=cols < v_local)


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
    kernel = triton.heuristics({"HAS_ENTROPY": lambda args: args["grad_entropy_ptr"] is not None})(
        triton.jit(_grad_kernel)
    )
    if autotune:
        # Restore `out` between tuning runs: with out=logits the kernel overwrites its input.
        kernel = triton.autotune(
            configs=_autotune_configs(), key=["v_local"], restore_value=["out_ptr"]
        )(kernel)
    return kernel


def _check_out(out: torch.Tensor, logits: torch.Tensor) -> bool:
    """Validates ``out``; True when it is a narrower-dtype alias of the logits' rows."""
    check_logits("out", out)
    if out.shape != logits.shape:
        raise ValueError(
            f"out must have the logits' shape {list(logits.shape)}, got {list(out.shape)}"
        )
    if out.device != logits.device:
        raise ValueError(f"out is on {out.device}, expected {logits.device} like the logits")
    if out.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
        return False
    row_bytes = out.stride(0) * out.element_size()
    same_rows = out.size(0) <= 1 or row_bytes == logits.stride(0) * logits.element_size()
    if out.data_ptr() != logits.data_ptr() or not same_rows:
        raise ValueError(
            "out shares memory with logits: it must be logits itself or a view whose row r "
            "starts where logits row r starts"
        )
    if out.element_size() > logits.element_size():
        raise ValueError(f"out ({out.dtype}) aliasing logits ({logits.dtype}) must not be wider")
    return out.element_size() < logits.element_size()


def _check_shift(shift: torch.Tensor, block: int, rows: int, n_valid: int, device) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"shift_block must be a positive int with block_shift, got {block!r}")
    nb = -(-n_valid // block)
    if not isinstance(shift, torch.Tensor) or tuple(shift.shape) != (nb, rows):
        got = getattr(shift, "shape", shift)
        raise ValueError(f"block_shift must be [NB={nb}, C={rows}], got {got}")
    if shift.dtype != torch.float32 or shift.device != device or not shift.is_contiguous():
        raise ValueError(f"block_shift must be contiguous fp32 on {device}, got {shift.dtype}")


def logits_grad(
    logits: torch.Tensor,
    targets_local: torch.Tensor,
    n_valid: int,
    inv_temperature: float,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None = None,
    entropy_pz: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_shift: torch.Tensor | None = None,
    shift_block: int = 0,
) -> torch.Tensor:
    """d loss / d logits of a [C, V_local] chunk (see the module docstring for the formula).

    Args:
        logits: [C, V_local] float32/bf16/fp16 raw logits, last dim contiguous.
        targets_local: [C] int64, target - vocab_start; outside [0, n_valid) = not in this shard.
        n_valid: real (non-padded) columns, 0 <= n_valid <= V_local.
        inv_temperature: 1 / temperature, finite and > 0.
        lse: [C] float32 global log-sum-exp of z.
        grad_logp: [C] float32 d loss / d logp.
        grad_entropy: [C] float32 d loss / d entropy, or None (no entropy term).
        entropy_pz: [C] float32 global sum_j p_j z_j; required with grad_entropy.
        out: [C, V_local] float output, or None. May alias the logits: `logits` itself, or a
            narrower-dtype view whose row r starts at logits row r (see the module docstring).
        block_shift: [NB, C] fp32 or None. Given, ``logits`` holds shifted tempered logits
            ``z - block_shift[j // shift_block]`` (``kernels.head_gemm``'s ``shifted``) and
            ``z = logits + shift`` replaces ``z = logits * inv_temperature``.
        shift_block: columns per block of ``block_shift`` (> 0 with it).

    Returns:
        [C, V_local] d logits in out's dtype (logits.dtype when out is None); padded columns 0.
    """
    require_triton()
    check_logits("logits", logits)
    rows, v_local = logits.shape
    check_scalars(n_valid, v_local, inv_temperature)
    dev = logits.device
    check_row_vector("targets_local", targets_local, rows, torch.int64, dev)
    check_row_vector("lse", lse, rows, torch.float32, dev)
    check_row_vector("grad_logp", grad_logp, rows, torch.float32, dev)
    if (grad_entropy is None) != (entropy_pz is None):
        raise ValueError("grad_entropy and entropy_pz must be given together (or both None)")
    if grad_entropy is not None:
        check_row_vector("grad_entropy", grad_entropy, rows, torch.float32, dev)
        check_row_vector("entropy_pz", entropy_pz, rows, torch.float32, dev)
    if block_shift is not None:
        _check_shift(block_shift, shift_block, rows, n_valid, dev)
    narrow_alias = out is not None and _check_out(out, logits)
    check_device("logits", logits)
    if out is None:
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if rows == 0 or v_local == 0:
        return out
    autotune = autotune_enabled()
    kernel = _build(interpret_mode(), autotune)
    args = (logits, targets_local, lse, grad_logp, grad_entropy, entropy_pz, block_shift, out)
    args += (n_valid, v_local, logits.stride(0), out.stride(0), float(inv_temperature), rows)
    flags = dict(NARROW_ALIAS=narrow_alias, HAS_SHIFT=block_shift is not None)
    if autotune:
        kernel[(rows,)](*args, max(shift_block, 1), **flags)
    else:
        kernel[(rows,)](*args, max(shift_block, 1), BLOCK_V=BLOCK_V, num_warps=NUM_WARPS, **flags)
    return out
